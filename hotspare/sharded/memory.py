"""How much host RAM a sharded job's buddy snapshots take, and whether they fit.

Rank r keeps its predecessor p's copies (runtime/sharded.py, transfer/buddy.py): p's snapshot
(parameters and optimizer state, taken every ``every`` steps, ``HOTSPARE_SNAPSHOT_EVERY``), one
arriving, and p's gradient logs since that snapshot (one per step, up to ``every``) and one
arriving. Its own snapshot and log go from its tensors' memory (transfer/buddy.py ``view``: no
copy). At its peak a rank holds::

    2 x shard(p) + (every + 1) x log(p)

(``need``). The ranks of one host hold theirs in that host's RAM, next to the training itself.

Each generation, every rank gathers every rank's shard and log size and its host's available
RAM (``/proc/meminfo`` MemAvailable, or ``HOTSPARE_HOST_RAM_BYTES``): rank 0 prints the cost
once, and before the job's first step every rank refuses to start (``HostMemoryError``, the same
verdict on every rank) when a host's snapshots would not fit, saying what to change. The host of
rank r is ``r // ranks_per_host`` (``LOCAL_WORLD_SIZE``), as torchrun and hotspare lay ranks out.
The sums are pure (``plan``); ``check`` gathers them (torch imported there).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from hotspare.errors import ConfigError

ENV_RAM = "HOTSPARE_HOST_RAM_BYTES"
MEMINFO = "/proc/meminfo"
MiB = float(1 << 20)


class HostMemoryError(ConfigError):
    """The buddy snapshots of a sharded job would not fit in a host's available RAM: the job
    stops before its first step, with the message (a spare would refuse the same)."""
    refuses_start = True      # the coordinator stops the job at once (runtime/steps.py ``report_crash``)


def available_bytes() -> int:
    """This host's available RAM: ``$HOTSPARE_HOST_RAM_BYTES`` if set, else MemAvailable; -1
    when neither can be read (then nothing is refused)."""
    raw = os.environ.get(ENV_RAM)
    if raw:
        try:
            return max(0, int(raw))
        except ValueError:
            raise ConfigError(f"{ENV_RAM}={raw!r}: give the host's available RAM in bytes, e.g. 68719476736") from None
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return -1


@dataclass(frozen=True)
class MemoryPlan:
    need: list[int]                 # per rank: the bytes it holds at its peak
    hosts: list[tuple[int, int, int]]   # per host: (first rank, bytes its ranks hold, bytes available or -1)
    refusal: str | None             # why the job cannot start, or None

    def summary(self, shard0: int) -> str:
        top = max(range(len(self.hosts)), key=lambda h: self.hosts[h][1])
        first, used, avail = self.hosts[top]
        where = (f"; {used / MiB:.2f} MiB on host {top} (ranks from {first}), of {avail / MiB:.1f} MiB available"
                 if avail >= 0 else "")
        return (f"sharded job, before step 0: rank 0's shard is {shard0 / MiB:.2f} MiB (with the optimizer's state "
                f"its first step makes, estimated); buddy snapshots take up to {max(self.need) / MiB:.2f} MiB of "
                f"host RAM per rank (2 copies of its predecessor's shard, its gradient logs, its own outgoing "
                f"copies){where}")


def plan(shard: list[int], log: list[int], avail: list[int], per_host: int, stride: int, every: int = 1) -> MemoryPlan:
    """The bytes each rank and each host holds for the buddy snapshots, and whether they fit.
    ``shard``/``log``/``avail``: every rank's shard bytes, gradient-log bytes and its host's
    available RAM (-1: unknown); the predecessor of r is ``r - stride``."""
    world = len(shard)
    per_host = per_host if 0 < per_host <= world and world % per_host == 0 else world
    need = [2 * shard[(r - stride) % world] + (every + 1) * log[(r - stride) % world]
            for r in range(world)]
    hosts, refusal = [], None
    for first in range(0, world, per_host):
        ranks = range(first, first + per_host)
        used = sum(need[r] for r in ranks)
        known = [avail[r] for r in ranks if avail[r] >= 0]
        free = min(known) if known else -1
        hosts.append((first, used, free))
        if refusal is None and free >= 0 and used > free:
            refusal = (f"the buddy snapshots of this sharded job need {used / MiB:.1f} MiB of host RAM on the host of "
                       f"ranks {first}..{first + per_host - 1} ({max(need[r] for r in ranks) / MiB:.1f} MiB per rank: "
                       f"2 copies of its predecessor's shard, its gradient log and its own outgoing copy), and only "
                       f"{free / MiB:.1f} MiB is available there (MemAvailable; {ENV_RAM} overrides it). Shard the "
                       f"model over more ranks (smaller shards), run fewer ranks per host, or free host memory")
    return MemoryPlan(need, hosts, refusal)


def check(group, rank: int, world: int, shard_bytes: int, log_bytes: int, stride: int, every: int, *,
          say: bool, before_first_step: bool) -> bool:
    """Every rank of a generation, at its snapshot exchange (a collective: all or none): gather
    the sizes, print the cost on rank 0 when ``say``, and raise ``HostMemoryError`` before the
    job's first step when a host's snapshots would not fit. True when rank 0 said it."""
    import torch
    mine = torch.tensor([shard_bytes, log_bytes, available_bytes()], dtype=torch.int64)
    rows = torch.empty(world * 3, dtype=torch.int64)
    group.all_gather(rows, mine).wait()
    table = rows.view(world, 3).tolist()
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    p = plan([t[0] for t in table], [t[1] for t in table], [t[2] for t in table], per_host, stride, every)
    if say and rank == 0:
        print(f"hotspare: {p.summary(table[0][0])}", file=sys.stderr, flush=True)
    if p.refusal is not None and before_first_step:
        raise HostMemoryError(p.refusal)
    return say and rank == 0


# Tensors an optimizer keeps per parameter, each the parameter's size: what its first step will
# add to a shard (torch.optim's own layouts). An optimizer not named here is taken to be
# Adam-like (two), the common case and the safe side of a refusal.
_STATE_TENSORS = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2, "Rprop": 2,
                  "Adagrad": 1, "ASGD": 1}


def state_per_param(opt) -> int:
    """How many parameter-sized tensors ``opt`` will keep per parameter once it has stepped."""
    name = type(opt).__name__
    g = opt.param_groups[0] if opt.param_groups else {}
    if name == "SGD":
        return 1 if g.get("momentum", 0) else 0
    if name == "RMSprop":
        return 1 + bool(g.get("momentum", 0)) + bool(g.get("centered", False))
    return _STATE_TENSORS.get(name, 2) + (1 if g.get("amsgrad", False) else 0)


def unmade_state_bytes(opt) -> int:
    """The bytes ``opt``'s state will add to this rank's shard at its first step, if it has not
    stepped yet (0 once it has: its state is in the shard then)."""
    if opt is None or opt.state:
        return 0
    from torch.distributed.tensor import DTensor
    size = sum((q.to_local() if isinstance(q, DTensor) else q).numel() * q.element_size()
               for g in opt.param_groups for q in g["params"])
    return state_per_param(opt) * size


def log_bytes(modules) -> int:
    """The bytes of a gradient log: one gradient per local parameter shard of ``modules``."""
    from torch.distributed.tensor import DTensor
    total = 0
    for m in modules:
        for q in m.parameters():
            local = q.to_local() if isinstance(q, DTensor) else q
            total += local.numel() * local.element_size()
    return total


__all__ = ["ENV_RAM", "HostMemoryError", "MemoryPlan", "available_bytes", "check", "log_bytes", "plan",
           "state_per_param", "unmade_state_bytes"]
