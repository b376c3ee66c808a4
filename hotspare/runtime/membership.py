"""Which generation a worker is in, as which rank, and the one way between generations.

A worker leaves a generation for one of four reasons, and each is the same sequence
(``leave``): tear the group down, tell the coordinator why (``failed``, ``paused``, ``done``, or
``failed`` again when a peer fails while joining), wait for its next order, enter the
generation it names. Entering (``enter``) either joins a generation (build its group, then the
state sync that brings receivers to the source's committed step), or, for a rank that live
migration replaces, hands its own state to the spare and exits.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Callable

import torch.distributed as dist

from hotspare.errors import JobFailed, PeerFailure, StateMismatch
from hotspare.pg import GenerationGroup
from hotspare.runtime.failures import Collectives
from hotspare.runtime.hooks import WorkerHooks
from hotspare.runtime.link import AgentLink
from hotspare.runtime.rankstate import RankState, RowTable
from hotspare.runtime.statesync import StateSync

HANDOFF_JOIN_TIMEOUT_S = 30.0


@dataclasses.dataclass
class Progress:
    committed: int = -1      # last committed step on this rank
    applied: int = -1        # last step whose optimizer update is in the state


class Membership:
    def __init__(self, link: AgentLink, store: dist.Store, sync: StateSync, progress: Progress,
                 rows: RowTable, rankstate: RankState, hooks: WorkerHooks, *, backend: str,
                 join_timeout_s: float, restore: Callable[[str], int], on_checkpoint: Callable[[str], None]):
        self.link, self.store, self.sync, self.progress = link, store, sync, progress
        self.rows, self.rankstate, self.hooks = rows, rankstate, hooks
        self.backend, self.join_timeout_s = backend, join_timeout_s
        self._restore, self._on_checkpoint = restore, on_checkpoint
        self.generation, self.rank, self.world_size = 0, None, 1
        self.group: GenerationGroup | None = None
        self.pending_sync: dict[str, Any] | None = None   # deferred until the script tracked its state
        self.verify_at = -1          # the step whose vote checks a state transfer
        self.joins = 0               # generations joined so far (caches of the group's tensors expire)
        # Sharded jobs (runtime/sharded.py): called with the join message on every rank of a
        # generation just before and just after its state sync (each rank's shard is kept from
        # the sync before, and restored after).
        self.before_sync: list[Callable[[dict[str, Any]], None]] = []
        self.after_sync: list[Callable[[dict[str, Any]], None]] = []
        link.on_abort(self._aborted)

    # ------------------------------------------------------------------ the group
    def _aborted(self, upto: int) -> None:
        group = self.group
        if group is not None and group.gen <= upto:
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
        if self.group.gen <= self.link.aborted_upto:
            self.group.abort()
        self.group.connect()         # published first, so an abort can interrupt the rendezvous
        return self.group

    # ------------------------------------------------------------------ between generations
    def leave(self, type_: str, stopped: str | None, teardown: bool = True, **fields: Any) -> bool:
        """Leave this generation saying ``type_``; enter the next. False when released instead
        (raises JobFailed with ``stopped`` when a release is not the expected end). A finished
        rank keeps its group (``teardown=False``) until it is released or joins another: a peer
        may still be receiving its share of the last step's collectives."""
        if teardown:
            self.teardown()
        msg = self._report(type_, **fields)
        if msg is None:
            if stopped is not None:
                raise JobFailed(stopped)
            return False
        self.enter(msg)
        return True

    def _report(self, type_: str, **fields: Any) -> dict[str, Any] | None:
        self.link.send(type_, gen=self.generation, rank=self.rank, **fields)
        return self.link.await_order(self._on_checkpoint)

    def enter(self, msg: dict[str, Any]) -> None:
        """Join the generation of ``msg``; if a peer fails meanwhile, report it and join the next."""
        errors = Collectives()
        while True:
            if msg["type"] == "handoff":
                self._handoff(msg)           # never returns: this worker's part is over
            try:
                self._join(msg)
                return
            except Exception as e:
                if isinstance(e, StateMismatch) or not errors.is_peer_failure(e, self.broken):
                    raise
                self.teardown()
                msg = self._report("failed", committed=self.progress.committed, error=f"during join: {e}"[:300])
                if msg is None:
                    raise JobFailed("the coordinator stopped the job during recovery") from None

    def _join(self, msg: dict[str, Any]) -> None:
        self.teardown()
        self.generation, self.rank, self.world_size = msg["gen"], msg["rank"], msg["world"]
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
        self.rows.drop_top()               # the old generation's top-of-iteration gather is spent
        self.link.send("joined", gen=self.generation, rank=self.rank, bytes=nbytes,
                       committed=self.progress.committed, pending=self.pending_sync is not None,
                       timings={"rebuild": rebuild_s, "transfer": transfer_s})

    def sync_state(self, msg: dict[str, Any]) -> tuple[int, float]:
        """Bring every receiver to the source's committed state; returns (bytes, seconds)."""
        for hook in self.before_sync:
            hook(msg)
        out = self._sync_replicated(msg)
        for hook in self.after_sync:       # every rank of the generation, after the sync
            hook(msg)
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
        if self.rank == source:
            self.hooks.transfer(self.generation, self.rank, "source")
            if self.progress.committed != target:
                raise StateMismatch(f"rank {self.rank} was chosen as source for step {target} "
                                    f"but holds step {self.progress.committed}")
            stats = self.sync.send(self.group.store, key, target, self.rows.start_rows(target),
                                   self.world_size, source, receivers)
        else:
            self.hooks.transfer(self.generation, self.rank, "receiver")
            step, stats = self.sync.receive(self.group.store, key, "the source rank", source, receivers,
                                            self.rank, self.world_size)
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
    def _handoff(self, msg: dict[str, Any]) -> None:
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
