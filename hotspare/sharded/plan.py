"""Pure decisions for sharded recovery: who holds whose snapshot, and where each rank's shard
comes from after a failure. No torch, no sockets: the runtime gathers every rank's status,
calls ``plan_restore``, and carries out what it returns on every rank alike.

A rank's *buddy* keeps the rank's committed shards (``BuddyStatus``): ``snap_step`` = the step
of the state snapshot it holds (the state after that step's optimizer update; a snapshot is
taken every few steps), and ``log_step`` = the last step whose final gradients (and optimizer
hyperparameters) it holds, the logs of every step from ``snap_step + 1`` to it, or -2. A rank is
brought to the target step T from its own memory when its shard is already at T, else from its
buddy: the snapshot of T, or an older snapshot of step s plus the logs of steps s+1 .. T,
replayed in order on the restored rank (the same optimizer, the same gradients: the same bits).
"""
from __future__ import annotations

from dataclasses import dataclass

NONE = -2     # no step: nothing held / this rank's own shard is not its committed one


def buddy_of(rank: int, world: int, stride: int) -> int:
    """The rank that keeps ``rank``'s snapshot: ``stride`` ranks on (``stride`` = ranks per host,
    so the buddy is on the next host; 1 on a single host)."""
    if world < 2:
        raise ValueError("a buddy snapshot needs at least 2 ranks")
    if stride <= 0 or stride % world == 0:
        raise ValueError(f"buddy stride {stride} puts every rank on itself in a world of {world}; "
                         f"use the number of ranks per host (1 .. {world - 1})")
    return (rank + stride) % world


def default_stride(world: int, local_world: int) -> int:
    """Ranks per host when the job spans several hosts (the buddy is then never on the same
    host), else 1: a single-host job keeps each snapshot in the next rank."""
    return local_world if 0 < local_world < world and world % local_world == 0 else 1


@dataclass(frozen=True)
class BuddyStatus:
    own_step: int      # the step this rank's own shard is at, or NONE (a spare; or overwritten)
    held_for: int      # the rank whose snapshot this rank holds (its predecessor), or NONE
    snap_step: int     # the step of that snapshot, or NONE
    log_step: int      # the last step of the gradient logs on top of it (a run from snap_step + 1), or NONE
    fresh_step: int = NONE   # a newer snapshot that arrived after the last gate, or NONE

    def row(self) -> list[int]:
        return [self.own_step, self.held_for, self.snap_step, self.log_step, self.fresh_step]


@dataclass(frozen=True)
class Source:
    rank: int          # the rank to restore
    holder: int        # the rank that sends it its shard
    kind: str          # "replica": the holder's own live shard (HSDP); "fresh" / "snapshot": the
                       # holder's copy of the target step; "replay": its snapshot of snap_step + the
                       # logs of snap_step + 1 .. target
    snap_step: int

    @property
    def replay(self) -> bool:
        return self.kind == "replay"


def plan_restore(status: list[BuddyStatus], target: int, stride: int,
                 replicas: list[list[int]] | None = None) -> tuple[list[Source], str | None]:
    """Where each rank's shard comes from to reach ``target``: the transfers to run (ranks
    already at ``target`` need none), and None; or ([], reason) when some rank's shard exists
    nowhere in memory at a usable step (its replicas and its buddy were lost too, or hold an older
    step), which only a checkpoint can restore. ``replicas``: the groups of ranks that hold the
    same shard (HSDP's replicate dimension); a live replica at ``target`` is preferred: it is
    the shard itself, no replay."""
    world = len(status)
    peers = {r: [q for q in g if q != r] for g in (replicas or []) for r in g}
    out: list[Source] = []
    for rank, st in enumerate(status):
        if st.own_step == target:
            continue
        live = [q for q in peers.get(rank, []) if status[q].own_step == target]
        if live:
            out.append(Source(rank, live[0], "replica", target))
            continue
        holder = buddy_of(rank, world, stride)
        h = status[holder]
        if h.held_for != rank or h.snap_step == NONE:
            return [], (f"rank {rank}'s shard is not in memory: no replica of it is at step {target} and its "
                        f"buddy rank {holder} holds no copy of it (lost too, or joined after it)")
        if h.fresh_step == target:
            out.append(Source(rank, holder, "fresh", target))
        elif h.snap_step == target:
            out.append(Source(rank, holder, "snapshot", target))
        elif h.snap_step < target <= h.log_step:
            out.append(Source(rank, holder, "replay", h.snap_step))
        else:
            return [], (f"rank {rank}'s buddy rank {holder} holds its snapshot of step {h.snap_step} "
                        f"(logs up to {h.log_step}), not of step {target} nor an older one with the logs "
                        f"up to {target}")
    return out, None


__all__ = ["BuddyStatus", "Source", "NONE", "buddy_of", "default_stride", "plan_restore"]
