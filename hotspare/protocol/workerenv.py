"""The worker environment contract: what a managed worker is told through its environment.

The launcher and the node agent write it (``WorkerEnv.to_env``), the runtime reads it once
(``WorkerEnv.from_env``); no other module reads a ``HOTSPARE_*`` variable of a worker. Standard
torch.distributed variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) are written beside it, as torchrun writes them, so a script that reads them
sees what it expects.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from hotspare.errors import ConfigError

PREFIX = "HOTSPARE_"
BACKENDS = ("gloo", "nccl")
ROLES = ("active", "spare")

# field -> environment variable. The agent's address is what makes a process "managed".
_VARS = {
    "agent": "HOTSPARE_AGENT",                 # host:port of the node agent
    "worker": "HOTSPARE_WORKER_ID",
    "role": "HOTSPARE_ROLE",                   # active | spare
    "device": "HOTSPARE_DEVICE",               # the device slot the agent assigned, if any
    "backend": "HOTSPARE_BACKEND",             # gloo | nccl: each generation's process group
    "join_timeout_s": "HOTSPARE_JOIN_TIMEOUT",  # seconds to form a generation's group
    "fingerprint_every": "HOTSPARE_FINGERPRINT_EVERY",   # steps between health votes (0: no fingerprint)
    "checkpoint_dir": "HOTSPARE_CHECKPOINT_DIR",
    "checkpoint_every": "HOTSPARE_CHECKPOINT_EVERY",     # steps; 0 with checkpoint_seconds 0: none
    "checkpoint_seconds": "HOTSPARE_CHECKPOINT_SECONDS",
    "checkpoint_key": "HOTSPARE_CHECKPOINT_KEY",         # the signing key's file
    "resume_dir": "HOTSPARE_RESUME_DIR",       # --resume DIR: may be read, never written
    "faults": "HOTSPARE_FAULTS",               # 1: the fault-injection plug-in is loaded (testing)
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerEnv:
    agent: str
    worker: str
    role: str = "active"
    device: str | None = None
    backend: str = "gloo"
    join_timeout_s: float = 5.0
    fingerprint_every: int = 10
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_seconds: float = 0.0
    checkpoint_key: str | None = None
    resume_dir: str | None = None
    faults: bool = False

    def __post_init__(self) -> None:
        if not self.agent or ":" not in self.agent:
            raise ConfigError(f"{_VARS['agent']} must be host:port, got {self.agent!r}")
        if not self.worker:
            raise ConfigError(f"{_VARS['worker']} is empty")
        if self.role not in ROLES:
            raise ConfigError(f"{_VARS['role']} must be one of {ROLES}, got {self.role!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"{_VARS['backend']} must be one of {BACKENDS}, got {self.backend!r}")
        if not self.join_timeout_s > 0:
            raise ConfigError(f"{_VARS['join_timeout_s']} must be > 0, got {self.join_timeout_s}")
        if self.fingerprint_every < 0 or self.checkpoint_every < 0 or self.checkpoint_seconds < 0:
            raise ConfigError("fingerprint_every, checkpoint_every and checkpoint_seconds must be >= 0")

    def to_env(self) -> dict[str, str]:
        """The variables to set in the worker's environment (unset fields are left out)."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            out[_VARS[field.name]] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        return out

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "WorkerEnv | None":
        """The contract as this process's environment states it; None when not managed (no
        agent: plain ``python`` or ``torchrun``). A malformed value is a ConfigError naming it."""
        if _VARS["agent"] not in environ:
            return None
        kwargs = {}
        for field in dataclasses.fields(cls):
            raw = environ.get(_VARS[field.name])
            if raw is None:
                continue
            kwargs[field.name] = _parse(field.name, raw)
        return cls(**kwargs)

    @classmethod
    def variables(cls) -> dict[str, str]:
        """field -> environment variable, for documentation and for clearing a child's env."""
        return dict(_VARS)


_INTS = {"fingerprint_every", "checkpoint_every"}
_FLOATS = {"join_timeout_s", "checkpoint_seconds"}


def _parse(name: str, raw: str):
    try:
        if name in _INTS:
            return int(raw)
        if name in _FLOATS:
            return float(raw)
    except ValueError:
        raise ConfigError(f"{_VARS[name]}={raw!r} is not a number") from None
    if name == "faults":
        if raw not in ("0", "1"):
            raise ConfigError(f"{_VARS[name]} must be 0 or 1, got {raw!r}")
        return raw == "1"
    return raw or None if name in ("device", "checkpoint_dir", "checkpoint_key", "resume_dir") else raw
