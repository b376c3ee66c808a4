"""The Slurm reconciler: brings each node's Slurm state in line with the registry, outside its lock.

The registry holds the desired state (a node is drained while any of its devices is out of
service: ``Registry.out_of_service``); Slurm holds the actual one. ``reconcile`` reads both and
drains or resumes (``slurm.plan``: only hotspare's own drains are ever undone), then records per
node what it applied and the last error (``Registry.record_slurm``, shown by ``hotspare health``).

Level-triggered, so ordering needs no lock: a writer that changes the registry while another
process reconciles reconciles after its write too, and a reconcile that finds the desired state
changed under it (another writer) goes round again, so the last word in Slurm is the registry's
last state. It runs after each write (the CLI commands) and periodically (``start``: in
``hotspare run``, beside the telemetry poller), so a call Slurm refused is retried.

Strict (``--slurm on``): a node Slurm does not know, or a failing ``scontrol``, is a
``SlurmError`` for the caller; the registry change stands either way (it is the desired state) and
the error is recorded, to be retried. Not strict (``auto``): unknown nodes are skipped and
failures become ``slurm: warning:`` notes, and a controller that does not answer when the
thread starts turns the reconciler off for the run (one warning; no reconcile waits on it).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Iterable, Mapping

from hotspare.health.registry import Registry
from hotspare.health.slurm import ENV_MODE, SlurmError, SlurmNodes, node_reason, plan

ROUNDS = 3              # reconciles of one node while writers keep changing what it should be


@dataclasses.dataclass
class Reconciled:
    notes: list[str] = dataclasses.field(default_factory=list)     # what it did, for the operator
    errors: dict[str, str] = dataclasses.field(default_factory=dict)   # node -> why not


class SlurmReconciler:
    def __init__(self, registry: Registry, slurm: SlurmNodes):
        self.registry, self.slurm = registry, slurm
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._off = False                   # start() found the controller not answering

    @classmethod
    def from_mode(cls, registry: Registry, mode: "str | SlurmNodes | None",
                  env: Mapping[str, str] | None = None) -> "SlurmReconciler | None":
        """``"on"`` / ``"off"`` / ``"auto"`` (``SlurmNodes.from_mode``); None when Slurm is off."""
        slurm = SlurmNodes.from_mode(mode, env)
        return None if slurm is None else cls(registry, slurm)

    @property
    def strict(self) -> bool:
        return self.slurm.strict

    def desired(self) -> dict[str, str | None]:
        """Per node of the registry, the drain reason it should have in Slurm (None: in service)."""
        out = self.registry.out_of_service()
        return {node: node_reason(out.get(node, ())) for node in self.registry.nodes()}

    def reconcile(self, nodes: Iterable[str] | None = None) -> Reconciled:
        """Reconcile ``nodes`` (default: every node of the registry). Strict: raises
        ``SlurmError`` when a node could not be brought in line (after recording why)."""
        done = self._reconcile(nodes)
        if done.errors and self.strict:
            raise SlurmError("; ".join(done.errors.values()) + " (the registry holds the change; it is "
                             "retried by the next reconcile: hotspare health --sync-slurm)")
        return done

    def _reconcile(self, nodes: Iterable[str] | None) -> Reconciled:
        done = Reconciled()
        for node in sorted(set(nodes) if nodes is not None else self.registry.nodes()):
            want, error = self.desired().get(node), None
            for _ in range(ROUNDS):
                try:
                    note, error = self._apply(node, want), None
                except SlurmError as e:
                    note, error = f"slurm: warning: node {node} not updated: {e}", str(e)
                if note:
                    done.notes.append(note)
                now = self.desired().get(node)
                if now == want:
                    break
                want = now                      # a writer changed it meanwhile: once more
            self.registry.record_slurm(node, want, error)
            if error is not None:
                done.errors[node] = error
        return done

    def _apply(self, node: str, want: str | None) -> str | None:
        current = self.slurm.state(node)
        if current is None:
            if self.strict:
                raise SlurmError(f"Slurm does not know node {node!r} (sinfo lists no such node); "
                                 f"device names must start with the Slurm NodeName")
            return None
        action = plan(current, want)
        if action == "drain":
            self.slurm.drain(node, want or "")
            return f"slurm: drained node {node} ({want})"
        if action == "resume":
            self.slurm.resume(node)
            return f"slurm: resumed node {node} (no hotspare device on it is out of service)"
        if want is not None and current.drained and not current.by_hotspare:
            return f"slurm: node {node} was already drained by someone else ({current.reason}); left as it is"
        return None

    # ------------------------------------------------------------------ in the background
    def start(self, period_s: float = 30.0, check_s: float = 1.0, log=print) -> None:
        """Reconcile in a thread: within ``check_s`` of a registry write, and every ``period_s``
        (a refused call is retried, a change made in Slurm by hand is seen). Not strict, and the
        controller does not answer (asked first, in the thread): a warning, and nothing more."""
        def loop() -> None:
            if not self.strict and (why := self.slurm.unreachable()) is not None:
                log(f"slurm: warning: the Slurm controller does not answer ({why}): nodes with a device "
                    f"out of service are not drained in Slurm by this run (hotspare health --sync-slurm "
                    f"does it later; ${ENV_MODE}=off silences this, =on makes it an error)")
                self._off = True
                return
            seen, waited = None, period_s
            while not self._stop.wait(check_s):
                waited += check_s
                try:
                    want = self.desired()      # one file read; Slurm is asked only on a change
                    if want != seen or waited >= period_s:
                        seen, waited = want, 0.0
                        self._report(self._reconcile(None), log)
                except Exception as e:  # noqa: BLE001 - the job goes on; the next round retries
                    log(f"slurm: warning: reconcile failed: {e}")
        self._thread = threading.Thread(target=loop, name="hotspare-slurm-reconcile", daemon=True)
        self._thread.start()

    def stop(self, log=print) -> None:
        """Stop the thread, after one last reconcile (the job's last changes reach Slurm)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if self._off:
            return
        try:
            self._report(self._reconcile(None), log)
        except Exception as e:  # noqa: BLE001
            log(f"slurm: warning: reconcile failed: {e}")

    @staticmethod
    def _report(done: Reconciled, log) -> None:
        for note in done.notes:
            log(note)
