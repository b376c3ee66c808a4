"""When memory cannot rebuild a sharded job's state, and what the report says each shard came from.

After a failure every rank of the new generation gathers what it holds and ``plan_restore``
(hotspare/sharded/plan.py) decides where each rank's shard comes from. When some lost shard is
in no survivor's memory (a rank and its buddy lost together; every replica of an HSDP shard and
its buddies), no step of the job exists whole in memory any more: every shard must come from
the same step, so the *whole job* goes back to its newest complete, verified sharded checkpoint
(hotspare/checkpoint/sharded.py) and the steps after it are lost -- and reported.

How, without a second decision path: every rank computed the same plan, so every rank
``unrecoverable`` at once: it says why on stderr, reports its join as failed with committed step
-1 ("this rank holds no complete copy of the job's state") and waits. The coordinator's one
recovery policy (policy/recovery.py ``plan_recovery``) then sees no copy anywhere: it vets the
newest checkpoint it was told of (the index's MAC and every shard's sha256; an older one if that
fails, coordinator/checkpoints.py), orders every rank to restore it, and the ledger records the
failure's path as "checkpoint" with its lost steps; with no checkpoint, it stops the job and
says so. Each rank then loads its own shard (hotspare/sharded/checkpoints.py).

``checked_plan`` verifies every buddy copy before it is sent (a corrupt one is never loaded:
the next source is used, and the report says why); ``sources`` turns a rank's restores into the
report's words: which source (an HSDP replica, a buddy snapshot, a checkpoint) and why that one.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, NoReturn

from hotspare.errors import PeerFailure, StateMismatch
from hotspare.sharded.plan import NONE, BuddyStatus, Source, plan_restore

Runtime = Any     # runtime/sharded.py ``ShardedRuntime``: typed loosely, the import goes one way

NO_COPY = -1      # the committed step a rank reports when it holds no complete copy of the job's state


def unrecoverable(rt: Runtime, target: int, reason: str) -> NoReturn:
    """Every rank, on the same plan: the job's state of ``target`` is not in memory."""
    job = rt.job
    rt.fallback_reason = f"the shards of step {target} are not all in memory: {reason}"
    print(f"hotspare: rank {job.rank}: sharded state of step {target} cannot be rebuilt from memory: {reason}; "
          "the job goes back to its newest sharded checkpoint (the steps after it are lost), or stops if "
          "there is none", file=sys.stderr, flush=True)
    job.progress.committed = job.progress.applied = NO_COPY
    raise PeerFailure(f"sharded state of step {target} is not in memory: {reason}"[:280])


BAD_FRESH, BAD_HELD = 1, 2     # a holder's copy failed its checksum: its newer snapshot / its snapshot (and log)


def checked_plan(rt: Runtime, status: list[BuddyStatus], target: int,
                 replicas: list[list[int]] | None) -> tuple[list[Source], str | None]:
    """``plan_restore``, with every copy a holder is about to send verified first (the checksum of
    the bytes it holds now: a snapshot whole on arrival may not be, hours later). A copy that
    fails is dropped on every rank alike (one gather of each rank's verdict) and the plan made
    again without it: the next source (the older snapshot and its log, or the checkpoint), with
    the reason in ``rt.checksum_notes`` for the report. A collective: every rank, the same plan."""
    rt.checksum_notes = {}
    while True:              # each round drops at least one copy, so it ends
        plan, reason = plan_restore(status, target, rt.stride, replicas)
        if reason is not None or all(src.kind == "replica" for src in plan):
            break
        flags = _gather(rt, _verify_mine(rt, plan))
        if not any(flags):
            break
        status = list(status)
        for h, flag in enumerate(flags):
            st = status[h]
            if flag == BAD_FRESH:
                what, status[h] = f"snapshot of step {st.fresh_step}", dataclasses.replace(st, fresh_step=NONE)
            elif flag == BAD_HELD:
                what = f"snapshot of step {st.snap_step}" + (f" or its logs up to step {st.log_step}"
                                                             if st.log_step != NONE else "")
                status[h] = dataclasses.replace(st, snap_step=NONE, log_step=NONE, fresh_step=NONE)
            else:
                continue
            rt.checksum_notes[st.held_for] = f"its buddy rank {h}'s {what} failed its checksum: not loaded"
    if reason is not None and rt.checksum_notes:
        reason += "; " + "; ".join(rt.checksum_notes.values())
    return plan, reason


def _verify_mine(rt: Runtime, plan: list[Source]) -> int:
    """This rank's verdict on the copies it is to send: 0, BAD_FRESH or BAD_HELD (dropped here)."""
    me, store = rt.job.members.rank, rt.store
    for src in plan:
        if src.holder != me or src.kind == "replica":
            continue
        try:
            if src.kind == "fresh":
                store.fresh.verify()
            else:
                store.state.verify()
                for log in store.logs_to(rt.job.progress.committed) if src.replay else ():
                    log.verify()
        except StateMismatch as e:      # transfer/buddy.py BadPacket
            print(f"hotspare: rank {me}: {e} (held for rank {src.rank}): the next source is used",
                  file=sys.stderr, flush=True)
            if src.kind == "fresh":
                store.fresh = None
                return BAD_FRESH
            store.clear()
            return BAD_HELD
    return 0


def _gather(rt: Runtime, mine: int) -> list[int]:
    import torch
    m = rt.job.members
    out = torch.empty(m.world_size, dtype=torch.int64)
    m.group.all_gather(out, torch.tensor([mine], dtype=torch.int64)).wait()
    return out.tolist()


_WHY = {
    "replica": "a live replica of the same shard (HSDP's replicate dimension) is at step {target}",
    "fresh": "no live replica of the shard; its buddy rank {holder} received its snapshot of step {target}",
    "snapshot": "no live replica of the shard; its buddy rank {holder} holds its snapshot of step {target}",
    "replay": ("no live replica of the shard, and no snapshot of step {target}: its buddy rank {holder} holds "
               "its snapshot of step {snap} and the gradient logs of steps {first}..{target}, replayed"),
    "own memory": "live migration: the migrating rank handed its own shard of step {target} over",
}
_SOURCE = {"replica": "HSDP replica", "fresh": "buddy snapshot", "snapshot": "buddy snapshot",
           "replay": "buddy snapshot + log", "own memory": "the rank's own memory"}


def sources(rt: Runtime, target: int) -> list[dict[str, Any]]:
    """This rank's restores to ``target`` (``ShardedRuntime.restores``), in the report's words."""
    out, rank = [], rt.job.members.rank
    note = getattr(rt, "checksum_notes", {}).get(rank)
    for r in rt.restores:
        if r.get("step") != target or r.get("source") not in _WHY:
            continue
        kind, holder = r["source"], r.get("from_rank")
        out.append({"rank": rank, "step": target, "source": _SOURCE[kind], "from_rank": holder,
                    "snapshot_step": r.get("snapshot_step"), "bytes": r.get("bytes"),
                    "why": _WHY[kind].format(target=target, holder=holder, snap=r.get("snapshot_step"),
                                             first=(r.get("snapshot_step") or 0) + 1)
                    + (f" ({note})" if note else "")})
    return out


def from_checkpoint(rt: Runtime, path: str) -> dict[str, Any]:
    """This rank's shard came from the checkpoint ``path`` (restored by the replicated sync's
    restore, hotspare/sharded/checkpoints.py): the restore record and the report's entry."""
    job = rt.job
    step = job.progress.committed
    why = getattr(rt, "fallback_reason", None) or (
        "the job was started with --resume" if job.generation <= 1 else
        "the job's state of its newest step was not all in memory (said by the ranks that saw it)")
    rt.fallback_reason = None
    entry = {"rank": job.rank, "step": step, "source": "checkpoint", "from_rank": None, "path": path,
             "why": why}
    rt.restores.append({"step": step, "source": "checkpoint", "from_rank": None, "path": path})
    print(f"hotspare: rank {job.rank}: shard of step {step} restored from the checkpoint {path} "
          f"(index signature and sha256 checked): {why}", file=sys.stderr, flush=True)
    return entry


__all__ = ["BAD_FRESH", "BAD_HELD", "NO_COPY", "checked_plan", "from_checkpoint", "sources", "unrecoverable"]
