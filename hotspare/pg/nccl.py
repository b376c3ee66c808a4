"""What NCCL needs from hotspare: the environment, the group options, the device of a rank.

The environment is set in ONE place, :func:`nccl_environment`; ``ProcessGroupNCCL`` reads these
variables when it is constructed (and ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` once per process), so
they must be in the worker's environment before its first NCCL group: the node agent writes
them with the rest of the worker's environment (``apply_nccl_environment``), and
``GenerationGroup`` applies them again (the same values, idempotent) just before it builds an
NCCL group, for a worker started some other way. Why each one: docs/GPU.md.

Nothing here imports CUDA state or needs a GPU: the functions are plain data and run on CPU.
"""
from __future__ import annotations

import datetime
from collections.abc import MutableMapping

# hotspare decides when a generation is broken (heartbeats, the coordinator) and aborts its
# communicator itself; torch must neither kill the survivor nor wait ten minutes to notice.
REQUIRED = {
    # 2 = CleanUpOnly: when a collective times out or fails, the watchdog aborts the
    # communicator and the work raises; the process lives. torch's default (3, SkipCleanUp) and
    # 1 (TearDown) kill the process: a survivor would die with the failed peer.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # The heartbeat monitor SIGABRTs the process when the watchdog is stuck (e.g. inside a CUDA
    # call of a wedged GPU). hotspare's agent fences hung workers itself (policy/hang.py), with
    # a reason the coordinator can act on, instead of a core dump 8 minutes later.
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    # Non-blocking communicators: ncclCommInitRank returns at once and is polled, so an abort
    # (ncclCommAbort) can interrupt a rendezvous whose peer died, and a hung collective can be
    # aborted from another thread without deadlocking on NCCL's internal locks.
    "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
    # work.wait() only makes the compute stream wait for NCCL's (no CPU block): hotspare's
    # GenerationGroup.wait polls completion itself, with the generation's abort in view.
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    # The error of a failed rank is not propagated through the store by torch: the
    # coordinator already tells every survivor, with the generation (stale ones are refused).
    "TORCH_NCCL_PROPAGATE_ERROR": "0",
}

# Defaults a user may override in their own environment.
DEFAULTS = {
    # NCCL's own warnings (a failed connection, a timeout) reach the worker's log.
    "NCCL_DEBUG": "WARN",
}

DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0   # NCCL: the watchdog's last line of defence (see below)


def nccl_environment(join_timeout_s: float = 30.0) -> dict[str, str]:
    """The environment variables hotspare sets for NCCL workers, as one dict.

    ``join_timeout_s`` bounds a non-blocking communicator's initialisation
    (``TORCH_NCCL_NONBLOCKING_TIMEOUT``, whole seconds, at least 1): torch's default is 30
    minutes, far longer than a generation may take to form."""
    if not join_timeout_s > 0:
        raise ValueError(f"join_timeout_s must be > 0, got {join_timeout_s}")
    return {**DEFAULTS, **REQUIRED,
            "TORCH_NCCL_NONBLOCKING_TIMEOUT": str(max(1, int(round(join_timeout_s))))}


def apply_nccl_environment(environ: MutableMapping[str, str], join_timeout_s: float = 30.0) -> list[str]:
    """Write :func:`nccl_environment` into ``environ`` (a worker's env dict, or ``os.environ``).

    hotspare's required values replace the user's (a survivor that torch kills defeats the
    point); the defaults only fill what is unset. Returns one line per user value replaced, for
    the agent to log."""
    env = nccl_environment(join_timeout_s)
    replaced = []
    for key, value in env.items():
        if key in REQUIRED or key == "TORCH_NCCL_NONBLOCKING_TIMEOUT":
            old = environ.get(key)
            if old is not None and old != value:
                replaced.append(f"{key}={old} replaced by {value} (hotspare supervises NCCL itself)")
            environ[key] = value
        else:
            environ.setdefault(key, value)
    return replaced


def cuda_device(device: "str | int | None", local_rank: int | None = None):
    """The ``torch.device`` an NCCL group binds to: ``device`` ("cuda:3", 3) or, when None,
    ``cuda:LOCAL_RANK``. A ValueError says how to fix a device that is not CUDA."""
    import torch

    if device is None:
        if local_rank is None:
            raise ValueError("an NCCL group needs its CUDA device: pass device='cuda:N' "
                             "(the agent's device slot, or cuda:LOCAL_RANK)")
        device = local_rank
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda" or dev.index is None:
        raise ValueError(f"an NCCL group needs a CUDA device with an index (cuda:N), got {device!r}")
    return dev


def nccl_options(timeout: datetime.timedelta, nonblocking: bool = True):
    """``ProcessGroupNCCL.Options`` for a generation: a non-blocking communicator (its
    ``config.blocking = 0``, which takes precedence over ``TORCH_NCCL_USE_COMM_NONBLOCKING``) and
    NCCL's streams at high priority, so gradient all-reduces are not queued behind compute
    kernels. ``timeout`` is the one ``init_process_group`` gets too (torch warns when they
    differ). Needs a torch built with NCCL."""
    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    opts._timeout = timeout
    if nonblocking:
        opts.config.blocking = 0
    return opts


def collective_timeout(timeout_s: float | None, backend: str) -> datetime.timedelta:
    """The process group's own collective timeout. gloo keeps 30 minutes (its hangs are freed by
    the socket abort, see generation.py); NCCL gets a short one (60 s by default): with
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` an expired collective aborts the communicator and
    raises in the worker, a backstop for a hang no heartbeat saw."""
    if timeout_s is None:
        timeout_s = DEFAULT_COLLECTIVE_TIMEOUT_S if backend == "nccl" else 1800.0
    if not timeout_s > 0:
        raise ValueError(f"the collective timeout must be > 0 seconds, got {timeout_s}")
    return datetime.timedelta(seconds=timeout_s)
