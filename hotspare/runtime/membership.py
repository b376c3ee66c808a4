"""Which generation a worker is in, as which rank: its group, joining a generation, the state
sync that brings receivers to the source's committed step, and live migration's hand-off.

When to join, leave or hand off is decided by the worker's phase machine (runtime/phase.py,
carried out by runtime/driver.py); this module does the joining and the handing off.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

import torch.distributed as dist

from hotspare.errors import PeerFailure, StateMismatch
from hotspare.pg import GenerationGroup
from hotspare.runtime.context import RankContext
from hotspare.runtime.statesync import StateSync

HANDOFF_JOIN_TIMEOUT_S = 30.0


class Membership:
    def __init__(self, ctx: RankContext, link: Any, store: dist.Store, sync: StateSync, *, backend: str,
                 join_timeout_s: float, restore: Callable[[str], int]):
        self.ctx, self.link, self.store, self.sync = ctx, link, store, sync
        self.progress, self.rows, self.rankstate, self.hooks = ctx.progress, ctx.rows, ctx.rankstate, ctx.hooks
        self.backend, self.join_timeout_s = backend, join_timeout_s
        self._restore = restore
        self.generation, self.rank, self.world_size = 0, None, 1
        self.prev_rank: int | None = None   # this worker's rank in the generation before (None: new)
        self.placement: list[int] | None = None   # an elastic job's: virtual rank -> rank (runtime/virtual.py)
        self.group: GenerationGroup | None = None
        self.aborted_upto = 0        # newest generation the coordinator aborted (phase.Aborted)
        self.pending_sync: dict[str, Any] | None = None   # deferred until the script tracked its state
        self.verify_at = -1          # the step whose vote checks a state transfer
        self.joins = 0               # generations joined so far (caches of the group's tensors expire)
        # Sharded jobs (runtime/sharded.py): called with the join message on every rank of a
        # generation just before and just after its state sync (each rank's shard is kept from
        # the sync before, and restored after).
        self.before_sync: list[Callable[[dict[str, Any]], None]] = []
        self.after_sync: list[Callable[[dict[str, Any]], None]] = []
        # Where this rank's shard came from in the generation it joined, and why (an after_sync
        # hook's entries, hotspare/sharded/fallback.py): sent as "restored", for the report.
        self.restored: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ the group
    def abort_upto(self, upto: int) -> None:
        """Abort this rank's group if its generation is ``upto`` or older (any thread); a group
        built later for such a generation is aborted as it is built."""
        self.aborted_upto = max(self.aborted_upto, upto)
        group = self.group
        if group is not None and group.gen <= self.aborted_upto:
            group.abort()

    @property
    def broken(self) -> bool:
        return self.group is None or self.group.aborted

    def check(self) -> None:
        if self.broken:
            raise PeerFailure(f"generation {self.generation} was aborted")

    def teardown(self) -> None:
        group, self.group = self.group, None
        if group is None:
            return
        group.destroy()
        if group.abort_stuck:
            # An NCCL communicator that would not abort holds this process's GPU: it cannot
            # join another generation. Exit, so the coordinator replaces it with a spare.
            print(f"hotspare: rank {self.rank}: the NCCL abort of generation {group.gen} did not return; "
                  "this worker exits to be replaced", file=sys.stderr, flush=True)
            os._exit(1)

    def _group(self, gen: int, rank: int, world: int, prefix: str, join_timeout: float) -> GenerationGroup:
        self.teardown()
        self.group = GenerationGroup(self.store, gen, rank, world, prefix, backend=self.backend,
                                     join_timeout_s=join_timeout)
        if self.group.gen <= self.aborted_upto:
            self.group.abort()
        self.group.connect()         # published first, so an abort can interrupt the rendezvous
        return self.group

    # ------------------------------------------------------------------ joining
    def join(self, msg: dict[str, Any]) -> None:
        """Join the generation of ``msg``: build its group, then sync state (raises on a peer's
        failure; the phase machine reports it and awaits the next order)."""
        self.teardown()
        self.prev_rank = self.rank
        self.generation, self.rank, self.world_size = msg["gen"], msg["rank"], msg["world"]
        self.placement = msg.get("placement")
        self.joins += 1
        if msg.get("moved"):
            # State moves in this generation: one update later, every rank's parameters must
            # still agree (the same step on every rank: the vote is a collective).
            self.verify_at = msg["target"] + 2
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size))
        self.hooks.joining(self.generation, self.rank)
        join_timeout = float(msg.get("join_timeout") or self.join_timeout_s)
        nbytes, transfer_s = self._receive_handoff(msg, join_timeout) if msg.get("handoff") else (0, 0.0)
        t0 = time.perf_counter()
        self._group(msg["gen"], msg["rank"], msg["world"], msg["prefix"], join_timeout)
        rebuild_s = time.perf_counter() - t0
        if self.sync.registry:
            nb, ts = self.sync_state(msg)
            nbytes, transfer_s = nbytes + nb, transfer_s + ts
        else:
            self.pending_sync = msg        # the initial sync, once the script has tracked its state
        self.link.send("joined", gen=self.generation, rank=self.rank, bytes=nbytes,
                       committed=self.progress.committed, pending=self.pending_sync is not None,
                       timings={"rebuild": rebuild_s, "transfer": transfer_s})

    def sync_state(self, msg: dict[str, Any]) -> tuple[int, float]:
        """Bring every receiver to the source's committed state; returns (bytes, seconds)."""
        for hook in self.before_sync:
            hook(msg)
        out = self._sync_replicated(msg)
        self.restored = []
        for hook in self.after_sync:       # every rank of the generation, after the sync
            hook(msg)
        if self.restored:
            self.link.send("restored", gen=self.generation, rank=self.rank, sources=self.restored)
        return out

    def _sync_replicated(self, msg: dict[str, Any]) -> tuple[int, float]:
        self.pending_sync = None
        if msg.get("restore"):
            # No copy survived in memory (or --resume): every rank reads the checkpoint itself.
            self.hooks.transfer(self.generation, self.rank, "restore")
            t0 = time.perf_counter()
            self._took(self._restore(msg["restore"]))
            return self.sync.registry.snapshot().nbytes(), time.perf_counter() - t0
        source, receivers, target = msg["source"], sorted(msg["receivers"]), msg["target"]
        if not receivers or (self.rank != source and self.rank not in receivers):
            return 0, 0.0
        key = f"state/{source}"
        # the rows of per-rank state are the previous generation's; an elastic job's placement may
        # have changed the world since (runtime/virtual.py): a rank takes its old row, a spare the
        # row of the rank that ran its first virtual rank
        before = msg.get("before")
        rows_world = len(set(before)) if before else self.world_size
        row = self.rank
        if before:
            mine = [v for v, p in enumerate(self.placement) if p == self.rank]
            row = self.prev_rank if self.prev_rank is not None else before[mine[0]]
        if self.rank == source:
            self.hooks.transfer(self.generation, self.rank, "source")
            if self.progress.committed != target:
                raise StateMismatch(f"rank {self.rank} was chosen as source for step {target} "
                                    f"but holds step {self.progress.committed}")
            # a changed placement: the rows as gathered (the keys of the rows published at an
            # iteration's top are reused by the new placement's ranks at once)
            rows = (self.rows.rows_for(target) if before else
                    self.rows.start_rows(target, self.store, rows_world))
            stats = self.sync.send(self.group.store, key, target, rows, rows_world, source, receivers)
        else:
            self.hooks.transfer(self.generation, self.rank, "receiver")
            step, stats = self.sync.receive(self.group.store, key, "the source rank", source, receivers,
                                            row, rows_world)
            self._took(step)
        return stats.bytes, stats.seconds

    def _took(self, step: int) -> None:
        self.progress.committed = self.progress.applied = step

    def apply_pending(self) -> None:
        """At the first step: what this rank was given while it had no tracked state."""
        step = self.sync.apply_staged()
        if step is not None:
            self._took(step)
        if self.pending_sync is not None:
            self.sync_state(self.pending_sync)

    # ------------------------------------------------------------------ live migration
    def handoff(self, msg: dict[str, Any]) -> None:
        """The migrating rank sends its own state to the spare taking its place, then exits."""
        code = 0
        try:
            group = self._group(msg["gen"], 0, 2, msg["handoff"],
                                float(msg.get("join_timeout") or HANDOFF_JOIN_TIMEOUT_S))
            self.hooks.transfer(msg["gen"], self.rank, "source")
            step = self.progress.committed
            # its state as its last step committed (with what it did after that step's exchange)
            table = self.rows.rows_for(step)
            own = (self.rows.own_at_commit if self.rows.own_at_commit is not None
                   else table.view(self.world_size, -1)[self.rank].clone() if table is not None
                   else self.rankstate.capture())
            stats = self.sync.send(group.store, "state/handoff", step, own, 1, 0, [1])
            self.link.send("handed_off", gen=msg["gen"], rank=self.rank, bytes=stats.bytes, seconds=stats.seconds)
        except Exception as e:   # the spare died: the new generation recovers from a replica
            print(f"hotspare: rank {self.rank}: handoff failed: {e}", file=sys.stderr, flush=True)
            code = 1
        self.teardown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def _receive_handoff(self, msg: dict[str, Any], join_timeout: float) -> tuple[int, float]:
        """The spare's half of a live migration: receive the old worker's state directly."""
        group = self._group(msg["gen"], 1, 2, msg["handoff"], join_timeout)
        self.hooks.transfer(msg["gen"], msg["rank"], "receiver")
        step, stats = self.sync.receive(group.store, "state/handoff", "the migrating rank", 0, [1],
                                        msg["rank"], msg["world"])
        self._took(step)
        self.teardown()
        return stats.bytes, stats.seconds
