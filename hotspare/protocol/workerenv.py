"""The worker environment contract: what a managed worker is told through its environment.

Two parts, one declaration each:

* ``JobEnv``, the job-wide part (backend, timeouts, checkpoints, ...). ``hotspare run`` builds
  it from its configuration and writes it into the node agents' base environment.
* ``WorkerEnv``, a ``JobEnv`` plus who and where this worker is (its agent, id, role, device).
  The node agent completes it for each worker it spawns (``WorkerEnv.of``) and writes it
  (``to_env``); the runtime reads it once (``WorkerEnv.from_env``).

No other module writes or reads a ``HOTSPARE_*`` variable of a worker. Standard
torch.distributed variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) are written beside it, as torchrun writes them, so a script that reads them
sees what it expects. docs/CONFIG.md lists every variable (``python -m hotspare.config.doc``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from hotspare.errors import ConfigError

PREFIX = "HOTSPARE_"
BACKENDS = ("gloo", "nccl")
ROLES = ("active", "spare")
LAUNCHER, AGENT = "hotspare run", "node agent"


def _var(default: Any, var: str, doc: str, writer: str = LAUNCHER) -> Any:
    """A field of the contract: its environment variable, what it means, who writes it."""
    return dataclasses.field(default=default, metadata={"var": var, "doc": doc, "writer": writer})


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobEnv:
    """The job-wide part: the same for every worker of a job."""
    backend: str = _var("gloo", "HOTSPARE_BACKEND", "gloo | nccl: each generation's process group (--backend)")
    join_timeout_s: float = _var(5.0, "HOTSPARE_JOIN_TIMEOUT", "seconds to form a generation's group "
                                 "(--join-timeout)")
    fingerprint_every: int = _var(10, "HOTSPARE_FINGERPRINT_EVERY", "steps between health votes; 0: no "
                                  "fingerprint (--fingerprint-every)")
    checkpoint_dir: str | None = _var(None, "HOTSPARE_CHECKPOINT_DIR", "the only directory a worker writes "
                                      "checkpoints to (--checkpoint-dir, else ./hotspare-checkpoints for a last one)")
    checkpoint_every: int = _var(0, "HOTSPARE_CHECKPOINT_EVERY", "steps between periodic checkpoints; 0 with "
                                 "checkpoint_seconds 0: none (--checkpoint-every)")
    checkpoint_seconds: float = _var(0.0, "HOTSPARE_CHECKPOINT_SECONDS", "at most this many seconds between "
                                     "periodic checkpoints (--checkpoint-seconds)")
    checkpoint_key: str | None = _var(None, "HOTSPARE_CHECKPOINT_KEY", "the file of the key that signs "
                                      "checkpoints (--checkpoint-key); also read by hotspare.checkpoint.auth")
    resume_dir: str | None = _var(None, "HOTSPARE_RESUME_DIR", "--resume DIR: may be read, never written")
    faults: bool = _var(False, "HOTSPARE_FAULTS", "1: the fault-injection plug-in is loaded (testing)")

    def __post_init__(self) -> None:
        _check_types(self)
        if self.backend not in BACKENDS:
            raise ConfigError(f"{_name('backend')} must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not (self.join_timeout_s > 0 and math.isfinite(self.join_timeout_s)):
            raise ConfigError(f"{_name('join_timeout_s')} must be a finite number of seconds > 0, "
                              f"got {self.join_timeout_s}")
        for name in ("fingerprint_every", "checkpoint_every", "checkpoint_seconds"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"{_name(name)} must be 0 or more, got {value}")

    def to_env(self) -> dict[str, str]:
        """The variables to set in the worker's environment (unset fields are left out)."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            out[field.metadata["var"]] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        return out

    @classmethod
    def from_env(cls, environ: Mapping[str, str]):
        """The contract as ``environ`` states it; a missing variable takes its default. A
        malformed value is a ConfigError naming the variable."""
        kwargs = {}
        for field in dataclasses.fields(cls):
            raw = environ.get(field.metadata["var"])
            if raw is not None:
                kwargs[field.name] = _parse(field, raw)
            elif field.default is dataclasses.MISSING:
                raise ConfigError(f"{field.metadata['var']} is not set (the {field.metadata['writer']} writes it)")
        return cls(**kwargs)

    @classmethod
    def variables(cls) -> dict[str, str]:
        """field -> environment variable, for documentation and for clearing a child's env."""
        return {f.name: f.metadata["var"] for f in dataclasses.fields(cls)}

    @classmethod
    def describe(cls) -> list[tuple[str, str, str, str]]:
        """(variable, field, who writes it, what it means) of every field, for docs/CONFIG.md."""
        return [(f.metadata["var"], f.name, f.metadata["writer"], f.metadata["doc"]) for f in dataclasses.fields(cls)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerEnv(JobEnv):
    """One worker's whole contract: the job's part plus who and where it is. The agent's
    address is what makes a process "managed"."""
    agent: str = _var(dataclasses.MISSING, "HOTSPARE_AGENT", "host:port of the node agent; its presence means managed", AGENT)
    worker: str = _var(dataclasses.MISSING, "HOTSPARE_WORKER_ID", "the worker's id (w0, w1, ...)", AGENT)
    role: str = _var("active", "HOTSPARE_ROLE", "active | spare", AGENT)
    device: str | None = _var(None, "HOTSPARE_DEVICE", "the device slot the agent assigned (host/gpu0), if any",
                              AGENT)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.agent or ":" not in self.agent:
            raise ConfigError(f"{_name('agent')} must be host:port, got {self.agent!r}")
        if not self.worker:
            raise ConfigError(f"{_name('worker')} is empty")
        if self.role not in ROLES:
            raise ConfigError(f"{_name('role')} must be one of {', '.join(ROLES)}, got {self.role!r}")

    @classmethod
    def of(cls, job: JobEnv, *, agent: str, worker: str, role: str = "active",
           device: str | None = None) -> "WorkerEnv":
        """The agent's half: ``job``'s part completed for one worker."""
        shared = {f.name: getattr(job, f.name) for f in dataclasses.fields(JobEnv)}
        return cls(**shared, agent=agent, worker=worker, role=role, device=device)

    def job(self) -> JobEnv:
        """The job-wide part alone."""
        return JobEnv(**{f.name: getattr(self, f.name) for f in dataclasses.fields(JobEnv)})

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "WorkerEnv | None":
        """This process's contract; None when not managed (no agent: plain ``python`` or
        ``torchrun``). A malformed value is a ConfigError naming the variable."""
        if _name("agent") not in environ:
            return None
        return super().from_env(environ)


def without_contract(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less every variable of the contract: what a child may inherit before its own
    contract is written into it (a stale ``HOTSPARE_RESUME_DIR`` of the caller must not leak)."""
    ours = set(WorkerEnv.variables().values())
    return {k: v for k, v in environ.items() if k not in ours}


def _name(field: str) -> str:
    return WorkerEnv.variables()[field]


_TYPES = {"str": str, "str | None": (str, type(None)), "int": int, "float": (int, float), "bool": bool}


def _check_types(env: JobEnv) -> None:
    """A value of the wrong type is refused here, not where a worker first uses it."""
    for field in dataclasses.fields(env):
        value = getattr(env, field.name)
        ok = _TYPES[field.type]
        if not isinstance(value, ok) or (field.type in ("int", "float") and isinstance(value, bool)):
            raise ConfigError(f"{field.metadata['var']} must be {field.type}, got {value!r}")


def _parse(field: dataclasses.Field, raw: str) -> Any:
    var = field.metadata["var"]
    if field.type in ("int", "float"):
        try:
            return int(raw) if field.type == "int" else float(raw)
        except ValueError:
            raise ConfigError(f"{var}={raw!r} is not {'an integer' if field.type == 'int' else 'a number'}") from None
    if field.type == "bool":
        if raw not in ("0", "1"):
            raise ConfigError(f"{var} must be 0 or 1, got {raw!r}")
        return raw == "1"
    if field.type == "str | None":
        return raw or None
    return raw
