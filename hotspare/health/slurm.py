"""Slurm integration: a node with an out-of-service device is drained in Slurm itself.

When a device leaves service (cordoned, draining, quarantined or retired), its node gets
``scontrol update NodeName=<node> State=DRAIN Reason="hotspare: <device> <state>: <reason>"``, so
Slurm schedules no new jobs there; running jobs keep running (that is what DRAIN means in Slurm).
When the last out-of-service device of the node returns to service, hotspare resumes the node
(``State=RESUME``). Node names are the part of the device name before the slash, which must be the
``NodeName`` Slurm knows (``hostname -s`` on most clusters).

hotspare only undoes its own drains: a node an administrator drained for another reason (its Slurm
reason does not start with ``hotspare:``) is neither resumed nor re-labelled by hotspare.

Enabling it (``SlurmNodes.from_mode``):

* ``"off"``: never touch Slurm.
* ``"on"``: always; a node Slurm does not know, an unreachable controller or a failing ``scontrol``
  is an error (``SlurmError``, with scontrol's stderr) for the caller, after the registry recorded
  the change and the error (the next reconcile retries).
* ``"auto"`` (the CLI's default, ``$HOTSPARE_SLURM`` overrides it): on when ``scontrol`` is on PATH
  and this host looks like part of a Slurm cluster (``$SLURM_CONF``, ``/etc/slurm/slurm.conf``,
  ``$SLURM_JOB_ID`` or ``$SLURM_CLUSTER_NAME``). Devices on nodes Slurm does not know are skipped,
  and Slurm failures become warnings. A job or service that finds the controller not answering
  (``scontrol ping``) leaves Slurm alone for its whole run, with one warning, rather than wait on
  every reconcile (``SlurmReconciler.start``).

This module is the I/O (``SlurmNodes``: sinfo, scontrol) and the pure decisions (``node_reason``,
``plan``). The registry never calls it: the reconciler (``hotspare.health.reconcile``) brings Slurm
in line with the registry outside the registry's lock, after writes and periodically, so a failed
call is recorded and retried.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path
from typing import Mapping, Sequence

from hotspare.errors import ConfigError, HotspareError

REASON_PREFIX = "hotspare:"
MODES = ("auto", "on", "off")
ENV_MODE = "HOTSPARE_SLURM"
_CONF_FILES = ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf")
_REASON_MAX = 200


class SlurmError(HotspareError):
    """scontrol or sinfo failed, or Slurm does not know a node; the message carries their stderr."""


@dataclasses.dataclass(frozen=True)
class NodeState:
    node: str
    state: str      # sinfo's long state without the trailing flag symbols: idle, drained, draining, mixed...
    reason: str     # "" when Slurm holds no reason

    @property
    def drained(self) -> bool:
        """DRAIN flag set: ``drained`` (idle) or ``draining`` (jobs still running)."""
        return "drain" in self.state

    @property
    def by_hotspare(self) -> bool:
        return self.reason.startswith(REASON_PREFIX)


def node_reason(entries: Sequence[tuple[str, str, str]]) -> str | None:
    """Slurm reason for a node, from its out-of-service devices ``(device, state, reason)``.

    ``None`` when the node has none (it should be in service). Deterministic (sorted by device), so
    re-syncing an unchanged registry issues no scontrol call.
    """
    if not entries:
        return None
    device, state, reason = sorted(entries)[0]
    text = f"{REASON_PREFIX} {device} {state}: {' '.join(reason.split())}"
    more = f" (+{len(entries) - 1} more device{'s' if len(entries) > 2 else ''})" if len(entries) > 1 else ""
    if len(text) + len(more) > _REASON_MAX:
        text = text[:_REASON_MAX - len(more) - 3] + "..."
    return text + more


def plan(current: NodeState, want: str | None) -> str | None:
    """What to do to a node: ``"drain"``, ``"resume"`` or ``None``. Pure.

    ``want`` is the drain reason the registry asks for, or ``None`` for "in service".
    """
    if want is not None:
        if not current.drained:
            return "drain"
        if current.by_hotspare and current.reason != want:
            return "drain"             # re-label our own drain; someone else's stays as it is
        return None
    if current.drained and current.by_hotspare:
        return "resume"
    return None


def mode_from_env(env: Mapping[str, str] | None = None) -> str:
    """The Slurm mode where no ``--slurm`` says: ``$HOTSPARE_SLURM``, else ``"auto"``."""
    return (os.environ if env is None else env).get(ENV_MODE) or "auto"


class SlurmNodes:
    """Drain and resume Slurm nodes with ``scontrol``; read their state with ``sinfo``."""

    def __init__(self, *, strict: bool = True, timeout: float = 30.0,
                 scontrol: str = "scontrol", sinfo: str = "sinfo"):
        self.strict = strict
        self.timeout = timeout
        self.scontrol = scontrol
        self.sinfo = sinfo

    def __repr__(self) -> str:
        return f"SlurmNodes(strict={self.strict})"

    # --- enabling ------------------------------------------------------------------------------
    @staticmethod
    def detected(env: Mapping[str, str] | None = None) -> bool:
        """True when ``scontrol`` is on PATH and this host looks like part of a Slurm cluster."""
        env = os.environ if env is None else env
        if shutil.which("scontrol", path=env.get("PATH")) is None:
            return False
        if env.get("SLURM_CONF") or env.get("SLURM_JOB_ID") or env.get("SLURM_CLUSTER_NAME"):
            return True
        return any(Path(p).is_file() for p in _CONF_FILES)

    @classmethod
    def from_mode(cls, mode: "str | SlurmNodes | None",
                  env: Mapping[str, str] | None = None) -> "SlurmNodes | None":
        """``"on"`` / ``"off"`` / ``"auto"`` (see the module docstring), an instance, or ``None`` (off)."""
        if mode is None or isinstance(mode, SlurmNodes):
            return mode
        if mode not in MODES:
            raise ConfigError(f"Slurm mode {mode!r} is not one of {', '.join(MODES)} "
                              f"(--slurm or ${ENV_MODE})")
        if mode == "off":
            return None
        if mode == "on":
            return cls(strict=True)
        return cls(strict=False) if cls.detected(env) else None

    def unreachable(self) -> str | None:
        """Why the controller does not answer ``scontrol ping`` (None: it does)."""
        try:
            out = self._run([self.scontrol, "ping"], timeout=min(self.timeout, 10.0))
        except SlurmError as e:
            return str(e)
        return None if "is UP" in out else (" ".join(out.split()) or "scontrol ping printed nothing")

    # --- commands ----------------------------------------------------------------------------
    def _run(self, argv: list[str], timeout: float | None = None) -> str:
        timeout = self.timeout if timeout is None else timeout
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError:
            raise SlurmError(f"{argv[0]} not found on PATH: install Slurm's client tools (Debian: "
                             f"slurm-client) or turn the Slurm integration off (--slurm off)") from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"'{' '.join(argv)}' did not answer within {timeout:g} s; "
                             f"is slurmctld reachable? (scontrol ping)") from None
        if out.returncode != 0:
            err = (out.stderr or out.stdout).strip() or "(no output)"
            raise SlurmError(f"'{' '.join(argv)}' failed (exit {out.returncode}): {err}")
        return out.stdout

    def state(self, node: str) -> NodeState | None:
        """The node's Slurm state and reason, or ``None`` when Slurm does not know the node."""
        return self.states([node]).get(node)

    def states(self, nodes: Sequence[str]) -> dict[str, NodeState]:
        """State and reason of each node Slurm knows among ``nodes``, with one ``sinfo`` call."""
        if not nodes:
            return {}
        out = self._run([self.sinfo, "--noheader", "--Node", "--nodes", ",".join(nodes),
                         "--format", "%N|%T|%E"])
        found: dict[str, NodeState] = {}
        for line in out.splitlines():
            name, state, reason = (line.split("|", 2) + ["", ""])[:3]
            if name in nodes and name not in found:     # a node in several partitions repeats
                reason = "" if reason.strip() == "none" else reason.strip()
                found[name] = NodeState(name, state.strip().rstrip("*~#!%$@^-+"), reason)
        return found

    def drain(self, node: str, reason: str) -> None:
        reason = " ".join(reason.split())
        if not reason.startswith(REASON_PREFIX):
            reason = f"{REASON_PREFIX} {reason}"
        self._run([self.scontrol, "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"])

    def resume(self, node: str) -> None:
        self._run([self.scontrol, "update", f"NodeName={node}", "State=RESUME"])
