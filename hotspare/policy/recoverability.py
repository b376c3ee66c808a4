"""Where each lost shard of a sharded (FSDP / HSDP) job comes back from: a pure decision.

Called by the fleet simulator's sharded mode (``hotspare simulate --sharded``) and meant for the
runtime's sharded recovery, so both answer "from memory or from a checkpoint?" the same way.
No torch, no sockets, no I/O.

The layout (``Placement``) is torch's ``init_device_mesh(..., (replicate, shard))``: global rank
``r`` is replica group ``r // shard`` and shard index ``r % shard``; ``replicate == 1`` is plain
FSDP. Ranks fill hosts in order, ``ranks_per_host`` each (host = ``r // ranks_per_host``).
With buddy snapshots on, rank ``r`` keeps a copy of its committed shards (parameters, optimizer
state, per-rank state) in the host RAM of its *buddy* ``(r + buddy_jump * ranks_per_host) mod
world``: the same local index ``buddy_jump`` hosts further on, like NVRx's ``replication_jump``,
so a rank and its buddy never share a host. ``snapshot_in`` says which process holds that copy:
``"agent"`` (the buddy host's agent, so it outlives the buddy's worker) or ``"worker"`` (the
buddy's training process, lost with it).

What a failure takes:

- ``dead_ranks``: workers gone with their GPU memory (a GPU fault, a crash); their host and its
  RAM (and agent) are alive.
- ``dead_hosts``: whole hosts gone: every rank on them, and every snapshot in their RAM.
- ``draining_ranks``: ranks leaving while still readable (live migration off a degrading GPU).

Every such rank needs its shards back. Sources, in the order tried (issue #31):

1. ``replica``: a rank of another replica group with the same shard index that is not dead
   (HSDP replicas hold identical shards after each all-reduce). Healthy ranks are preferred
   over draining ones.
2. ``own``: the rank itself, when it is draining: it hands its own shards over.
3. ``buddy``: its snapshot, if buddies are on and the process holding it survives.
4. ``checkpoint``: none of these. Every shard must come from the same step, so a single rank
   without an in-memory source sends the *whole job* back to its newest checkpoint
   (``stop`` when there is none).

``recover_shards`` returns one ``ShardSource`` per rank that needs recovery and the job-wide
path with a reason a person can read.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Literal

Source = Literal["replica", "own", "buddy", "checkpoint", "none"]
Path = Literal["memory", "checkpoint", "stop"]
SNAPSHOT_HOLDERS = ("agent", "worker")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """A sharded job's layout. ``world = replicate * shard``; ``buddy_jump`` is in hosts."""
    world: int
    ranks_per_host: int
    replicate: int = 1
    buddies: bool = True
    buddy_jump: int = 1
    snapshot_in: str = "agent"

    def __post_init__(self) -> None:
        if self.world < 1 or self.ranks_per_host < 1 or self.replicate < 1:
            raise ValueError("world, ranks_per_host and replicate must be at least 1")
        if self.world % self.replicate:
            raise ValueError(f"world ({self.world}) must be a multiple of replicate ({self.replicate})")
        if self.world % self.ranks_per_host:
            raise ValueError(f"world ({self.world}) must fill whole hosts of {self.ranks_per_host} ranks")
        if self.snapshot_in not in SNAPSHOT_HOLDERS:
            raise ValueError(f"snapshot_in must be one of {', '.join(SNAPSHOT_HOLDERS)}")
        if self.buddies and self.hosts > 1 and self.buddy_jump % self.hosts == 0:
            raise ValueError(f"buddy_jump {self.buddy_jump} puts every rank's buddy on its own host "
                             f"({self.hosts} hosts); pick a jump that is not a multiple of the hosts")

    @property
    def shard(self) -> int:
        return self.world // self.replicate

    @property
    def hosts(self) -> int:
        return self.world // self.ranks_per_host

    def host(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def group(self, rank: int) -> int:
        return rank // self.shard

    def replicas(self, rank: int) -> list[int]:
        """Ranks in the other replica groups holding the same shard as ``rank``."""
        index = rank % self.shard
        return [g * self.shard + index for g in range(self.replicate) if g != self.group(rank)]

    def buddy(self, rank: int) -> int | None:
        """The rank whose host RAM holds ``rank``'s snapshot (None: no buddies, or one host)."""
        if not self.buddies or self.hosts < 2:
            return None
        return (rank + self.buddy_jump * self.ranks_per_host) % self.world


@dataclasses.dataclass(frozen=True)
class ShardSource:
    rank: int                 # the rank that needs its shards back
    source: Source
    from_rank: int | None     # the replica, the rank itself, or the buddy; None for checkpoint/none
    reason: str


@dataclasses.dataclass(frozen=True)
class Recoverability:
    path: Path
    sources: tuple[ShardSource, ...]
    reason: str

    def count(self, source: Source) -> int:
        return sum(s.source == source for s in self.sources)


def recover_shards(placement: Placement, *, dead_ranks: Iterable[int] = (), dead_hosts: Iterable[int] = (),
                   draining_ranks: Iterable[int] = (), has_checkpoint: bool = True) -> Recoverability:
    """Decide, for ranks lost together, where each one's shards come from (see the module doc)."""
    p = placement
    hosts_down = set(dead_hosts)
    for h in hosts_down:
        if not 0 <= h < p.hosts:
            raise ValueError(f"host {h} is not in the job's {p.hosts} hosts")
    dead = set(dead_ranks) | {r for h in hosts_down for r in range(h * p.ranks_per_host,
                                                                   (h + 1) * p.ranks_per_host)}
    draining = set(draining_ranks) - dead
    for r in dead | draining:
        if not 0 <= r < p.world:
            raise ValueError(f"rank {r} is not in the job's world of {p.world}")

    def snapshot_survives(holder: int) -> bool:
        if p.host(holder) in hosts_down:
            return False
        return p.snapshot_in == "agent" or holder not in dead

    sources = []
    for r in sorted(dead | draining):
        alive = [q for q in p.replicas(r) if q not in dead]
        healthy = [q for q in alive if q not in draining]
        buddy = p.buddy(r)
        if alive:
            src = (healthy or alive)[0]
            sources.append(ShardSource(r, "replica", src,
                                       f"rank {r}: shard {r % p.shard} from replica rank {src}"))
        elif r in draining:
            sources.append(ShardSource(r, "own", r, f"rank {r}: still readable, hands over its own shards"))
        elif buddy is not None and snapshot_survives(buddy):
            sources.append(ShardSource(r, "buddy", buddy, f"rank {r}: snapshot from buddy rank {buddy} "
                                                          f"(host {p.host(buddy)})"))
        else:
            why = ("no replica, no buddy" if buddy is None else
                   f"no replica, and its buddy rank {buddy}'s snapshot is lost with "
                   + (f"host {p.host(buddy)}" if p.host(buddy) in hosts_down else "its worker"))
            fallback: Source = "checkpoint" if has_checkpoint else "none"
            sources.append(ShardSource(r, fallback, None, f"rank {r}: {why}"))
    missing = [s for s in sources if s.source in ("checkpoint", "none")]
    if not missing:
        kinds = sorted({s.source for s in sources})
        what = ", ".join(kinds) or "nothing lost"
        return Recoverability("memory", tuple(sources),
                              f"{len(sources)} rank(s) recover from memory ({what})")
    path: Path = "checkpoint" if has_checkpoint else "stop"
    head = "; ".join(s.reason for s in missing[:3]) + ("; ..." if len(missing) > 3 else "")
    then = ("the whole job goes back to its newest checkpoint" if has_checkpoint
            else "and there is no checkpoint: the job stops")
    return Recoverability(path, tuple(sources),
                          f"{len(missing)} rank(s) have no in-memory copy ({head}): {then}")
