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

``sources`` turns a rank's restores into the report's words: which source (an HSDP replica, a
buddy snapshot, a checkpoint) and why that one.
"""
from __future__ import annotations

import sys
from typing import Any, NoReturn

from hotspare.errors import PeerFailure

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


_WHY = {
    "replica": "a live replica of the same shard (HSDP's replicate dimension) is at step {target}",
    "fresh": "no live replica of the shard; its buddy rank {holder} received its snapshot of step {target}",
    "snapshot": "no live replica of the shard; its buddy rank {holder} holds its snapshot of step {target}",
    "replay": ("no live replica of the shard, and it was lost before it sent its snapshot of step {target}: "
               "its buddy rank {holder} holds the snapshot of step {prev} and the log of step {target}, replayed"),
}
_SOURCE = {"replica": "HSDP replica", "fresh": "buddy snapshot", "snapshot": "buddy snapshot",
           "replay": "buddy snapshot + log"}


def sources(rank: int, restores: list[dict[str, Any]], target: int) -> list[dict[str, Any]]:
    """This rank's restores to ``target`` (``ShardedRuntime.restores``), in the report's words."""
    out = []
    for r in restores:
        if r.get("step") != target or r.get("source") not in _WHY:
            continue
        kind, holder = r["source"], r.get("from_rank")
        out.append({"rank": rank, "step": target, "source": _SOURCE[kind], "from_rank": holder,
                    "snapshot_step": r.get("snapshot_step"), "bytes": r.get("bytes"),
                    "why": _WHY[kind].format(target=target, holder=holder, prev=target - 1)})
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


__all__ = ["NO_COPY", "from_checkpoint", "sources", "unrecoverable"]
