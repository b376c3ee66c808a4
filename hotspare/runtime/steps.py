"""The step protocol of one rank: entering a step, committing it or failing it, and the seam
the gradient exchange calls (runtime/ddp.py today; an FSDP integration would call the same).

Commit semantics (docs/CONTRACT.md): a step is committed on a rank when its block finished: its
optimizer stepped after a successful gradient reduction, and every rank's per-rank state of the
step was gathered beside that reduction (runtime/rankstate.py). A failed step puts back what it
touched (``rollback``): generators, buffers, data position, gradients as the step began.
"""
from __future__ import annotations

import enum
import math
import sys
import time
import traceback
from typing import Any, Iterable

import torch
import torch.distributed as dist

from hotspare.errors import ConfigError, PeerFailure, StateTrackingError
from hotspare.protocol.messages import MAX_ITEMS, MAX_NAME
from hotspare.runtime.context import RankContext
from hotspare.runtime.healthvote import HealthVote
from hotspare.runtime.link import AgentLink
from hotspare.runtime.membership import Membership
from hotspare.runtime.phase import StepFailed
from hotspare.runtime.vote import HealthFault

COMMITS_HELD, COMMITS_HELD_S = 8, 5.0   # a rank > 0 batches its commit reports (see _report_commit)
REPEAT_CHANGED = 100       # steps between reports of the same per-rank parts changed after the exchange
PLAIN_LOG_EVERY_S = 10.0   # outside hotspare run: rank 0's job.log prints at most this often


class Outcome(enum.Enum):
    COMMITTED = "committed"
    RECOVER = "recover"        # a peer failed or the vote went against the step: fail over
    RAISE = "raise"            # the script's own error (or not managed): let it propagate


class StepProtocol:
    def __init__(self, ctx: RankContext):
        self.ctx = ctx
        self.progress, self.rankstate, self.grads, self.rows = ctx.progress, ctx.rankstate, ctx.grads, ctx.rows
        self.loaders, self.collectives = ctx.loaders, ctx.collectives
        self.members: Membership | None = None
        self.link: AgentLink | None = None
        self.vote: HealthVote | None = None
        self.managed = False
        self.current: int | None = None
        self.total: int | None = None          # job.steps(total); None under job.epochs / job.step
        self.metrics: dict[str, Any] = {}
        self.step_times: list[float] = []      # seconds per committed step on this rank
        self.reducing_step: int | None = None  # the last step whose gradient exchange began here
        self._t0 = 0.0
        self._exchange_t: float | None = None
        self._entry: tuple[int, torch.Tensor, list[int]] | None = None   # (step, state, grads) as it began
        self._entry_buf: torch.Tensor | None = None
        self._reported_gen = -1                # the generation whose first commit was reported
        self._warned_after_exchange = False
        self._said_changed: tuple[list[str], int] | None = None   # (parts, step) last reported changed
        self._side: list = []                  # DDP's own collectives of this backward (reduce_side)
        self.changed_between: set[str] = set()  # per-rank parts changed between steps (Job._resume_point)
        # Outside hotspare run, rank 0 prints its metrics at most every print_every seconds.
        self.plain_rank: int | None = None
        self.print_every = PLAIN_LOG_EVERY_S
        self._last_print = 0.0

    def attach(self, members: Membership, link: AgentLink, vote: HealthVote) -> None:
        """Under ``hotspare run``: the generation, the control channel and the health vote."""
        self.members, self.link, self.vote, self.managed = members, link, vote, True

    @property
    def hooks(self):
        return self.ctx.hooks

    # ------------------------------------------------------------------ a step's life
    def enter(self, step: int) -> None:
        self.current = step
        self.collectives.clear()
        self._exchange_t = None
        self._side = []
        if self.vote is not None:
            self.vote.begin_step()
        self._t0 = time.perf_counter()
        if self.managed:
            m = self.members
            self.hooks.step_begins(m.generation, m.rank, step, self.total)
            # The state a re-run of this step starts from (grads: which are None, which zero).
            self._entry_buf = self.rankstate.capture(self._entry_buf)
            self._entry = (step, self._entry_buf, self.grads.mask())
            self.rows.drop_inflight()
            self.vote.start(step)

    def exit(self, step: int, ev: BaseException | None) -> tuple[Outcome, StepFailed | None]:
        """The step's outcome; for ``RECOVER``, the failure for the phase machine."""
        self.current = None
        if ev is None and self.managed:
            ev = self.vote.settle()     # a step without a gradient exchange: judge its vote here
        changed: list[str] = []
        if ev is None and self.managed:
            ev, changed = self._close_rows(step)
        if ev is None:
            self._commit(step, changed)
            return Outcome.COMMITTED, None
        if not self.managed or not isinstance(ev, Exception):
            return Outcome.RAISE, None
        if self.vote.tracking is not None:
            self.report_crash(step, StateTrackingError(self.vote.tracking))
            raise StateTrackingError(self.vote.tracking) from ev
        failed = self.vote.failed
        if failed is not None:
            # The vote failed on every rank alike, before any optimizer stepped: nobody is
            # blocked, the step is simply not committed; the suspect is replaced.
            self.vote.failed = None
            health = {"kind": failed.kind, "suspects": list(failed.suspects), "step": step, "detail": failed.detail}
            return Outcome.RECOVER, StepFailed(step, f"health vote: {failed.detail}", health, abort=False)
        if self.collectives.is_peer_failure(ev, self.members.broken):
            # The optimizer may have stepped before a later collective of the block failed.
            self.progress.committed = max(self.progress.committed, self.progress.applied)
            # the group is aborted at once (phase.StepFailed): the peers blocked on us are freed now
            return Outcome.RECOVER, StepFailed(step, f"{type(ev).__name__}: "
                                               f"{str(ev).splitlines()[0][:300] if str(ev) else ''}")
        self.report_crash(step, ev)
        return Outcome.RAISE, None

    def _commit(self, step: int, changed: list[str] = ()) -> None:
        p = self.progress
        p.committed = p.applied = step
        self._entry = None
        for loader in self.loaders:
            loader.committed()
        now = time.perf_counter()
        dt = now - self._t0
        self.step_times.append(dt)
        if self.managed:
            exch = self._exchange_t if self._exchange_t is not None else now
            v = self.vote
            # said when the set of parts changes, and at most every REPEAT_CHANGED steps otherwise
            said = self._said_changed
            fresh = bool(changed) and (said is None or said[0] != changed or step - said[1] >= REPEAT_CHANGED)
            if fresh:
                self._said_changed = (list(changed), step)
            extra = {"after_exchange": list(changed)} if fresh else {}
            self._report_commit(step=step, total=self.total, dt=dt, metrics=self.metrics,
                                compute=exch - self._t0, comm=now - exch, check=v.check_s,
                                check_cpu=v.check_cpu, fp=v.fp_s, **extra)
        elif self.plain_rank == 0 and self.metrics and (
                now - self._last_print >= self.print_every or step + 1 == self.total):
            self._last_print = now
            print(f"step {step} " + " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                             for k, v in self.metrics.items())
                  + f" | {dt * 1000:.0f} ms", flush=True)
        self.metrics = {}

    def _report_commit(self, **fields: Any) -> None:
        """Rank 0 reports every commit at once: the coordinator's count of committed steps, hence
        of steps lost to a total loss, stays exact. So does each rank's first commit of a
        generation (it ends a recovery's downtime). The other ranks' commits go out in batches
        (COMMITS_HELD or COMMITS_HELD_S), or with their next message: they carry per-rank step
        timings for the health service, and are all delivered, in order, unless the rank dies."""
        m = self.members
        if m.rank == 0 or self._reported_gen != m.generation or "after_exchange" in fields:
            self._reported_gen = m.generation
            self.link.send("commit", gen=m.generation, rank=m.rank, **fields)
        else:
            self.link.send_later(COMMITS_HELD, COMMITS_HELD_S, "commit", gen=m.generation, rank=m.rank, **fields)

    def report_crash(self, step: int, ev: BaseException) -> None:
        tb = "".join(traceback.format_exception(type(ev), ev, ev.__traceback__))
        m = self.members
        # ``refuses_start``: the job cannot run as configured (hotspare/sharded/memory.py): a spare
        # would refuse the same, so the coordinator stops the job with this message at once
        self.link.send("crash", gen=m.generation, rank=m.rank, step=step,
                       error=f"{type(ev).__name__}: {ev}"[:2000], traceback=tb[-20000:],
                       **({"refused": True} if getattr(ev, "refuses_start", False) else {}))

    def log(self, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            if len(k) > MAX_NAME:
                raise ConfigError(f"job.log: metric name {k[:40]!r}... is longer than {MAX_NAME} characters")
            v = float(v)
            self.metrics[k] = v if math.isfinite(v) else str(v)   # JSON has no NaN
        if len(self.metrics) > MAX_ITEMS:
            raise ConfigError(f"job.log: more than {MAX_ITEMS} metrics in one step")

    def rollback(self, failed: int) -> None:
        """Step ``failed`` failed on this rank: put back what it touched (the step contract)."""
        entry, self._entry = self._entry, None
        if entry is None or entry[0] != failed:
            return
        step, blob, mask = entry
        if self.progress.applied >= step:
            # The optimizer stepped before a later collective of the block failed: the update
            # stands; whatever the rest of the block would have cleared, gradients are zero.
            self.grads.reset(self.grads.mask())
            for loader in self.loaders:
                loader.committed()
            return
        self.rankstate.restore(blob)
        self.grads.reset(mask)
        for loader in self.loaders:
            loader.rollback()

    # ------------------------------------------------------------------ optimizer hooks
    def before_optimizer_step(self) -> None:
        if self.managed and self.current is not None:
            self.vote.check_reduced(self.current)

    def after_optimizer_step(self) -> None:
        if self.current is not None:
            self.progress.applied = self.current

    # ------------------------------------------------------------------ the gradient-exchange seam
    def reduce_bucket(self, index: int, buf: torch.Tensor, scale: bool = True) -> dist.Work | BaseException:
        """Start reducing one gradient bucket (buckets come in index order; 0 opens the step's
        exchange). Never raises: the failure is returned, for the bucket's future to carry.
        ``scale=False``: summed as it is (an elastic job's table of gradients, runtime/virtual.py)."""
        self._reached_exchange()
        m = self.members
        if m.broken:
            return PeerFailure(f"generation {m.generation} was aborted")
        try:
            if index == 0 and self.current is not None:
                # this rank's per-rank state, to the job's store before its first bucket
                self.rows.begin(m.group, m.world_size, self.current, store=m.store, rank=m.rank)
            flat = buf.view(-1)
            self.hooks.bucket(flat)
            # Scale by 1/world (DDP's own arithmetic, so the result is bitwise equal to plain
            # DDP's with the same layout) and note this rank's own NaN/Inf, in one pass.
            self.vote.scan_bucket(flat, m.world_size if scale else 1)
            return m.group.allreduce(buf)
        except Exception as e:
            self.collectives.note(e)
            return e

    def reduce_side(self, tensor: torch.Tensor) -> dist.Work:
        """A collective DDP's reducer issues besides the buckets: the all-reduce of the map of
        parameters each rank used (find_unused_parameters=True), on the generation's group. It
        comes after the backward's last bucket on every rank; ``finish_reduction`` waits for it."""
        m = self.members
        try:
            m.check()
            work = m.group.allreduce(tensor)
        except Exception as e:
            self.collectives.note(e)
            raise
        self._side.append(work)
        return work

    def finish_reduction(self, started: list[dist.Work | BaseException],
                         buffers: list[torch.Tensor]) -> BaseException | None:
        """At the end of backward, before any optimizer steps: wait for every bucket's reduction
        and the per-rank rows, and judge the step's vote. The error that fails the step, or None
        (then ``buffers`` are the reduced buckets whose NaN sentinels are read before the update)."""
        vote = self.vote.take()
        error: BaseException | None = None
        for work in started:
            if isinstance(work, BaseException):
                error = work
                break
            try:
                work.wait()
            except Exception as e:          # the first failure is the step's; DDP stops there too
                self.collectives.note(e)
                error = e
                break
        side, self._side = self._side, []
        for work in side if error is None else ():
            try:
                work.wait()
            except Exception as e:
                self.collectives.note(e)
                error = e
                break
        if error is None:
            try:
                self.rows.finish()
            except Exception as e:
                self.collectives.note(e)
                error = e
        if error is None and vote is not None:
            try:
                self.vote.judge(vote.wait()[0])  # raises HealthFault when the vote goes against this step
            except (HealthFault, StateTrackingError) as e:
                error = e
            except Exception as e:
                self.collectives.note(e)
                error = e
        self.vote.buckets = [] if error is not None else list(buffers)
        return error

    def broadcast_buffers(self, buffers: Iterable[torch.Tensor]) -> None:
        """DDP's buffer broadcast from rank 0, on the generation's group."""
        self.members.check()
        try:
            for b in buffers:
                dist.broadcast(b, src=0)
        except Exception as e:
            self.collectives.note(e)
            raise

    def _reached_exchange(self) -> None:
        """Note that this rank reached this step's gradient exchange. Nothing is sent: when the
        job stalls, the coordinator probes every rank, and the control thread answers with this
        (the hang detector tells the stuck rank from the ones waiting in the exchange)."""
        step = self.current
        if step is None:
            return
        if self._exchange_t is None:
            self.hooks.reduction_reached(time.perf_counter() - self._t0)
            self._exchange_t = time.perf_counter()
        self.reducing_step = step

    def _close_rows(self, step: int) -> tuple[BaseException | None, list[str]]:
        """At the end of a step: its rows are gathered (runtime/rankstate.py ``RowTable.close``);
        the error that fails the step, and the parts of this rank's per-rank state that changed
        after its last exchange (what its peers do not hold until its next one)."""
        m = self.members
        try:
            m.check()
            changed = self.rows.close(m.group, m.world_size, step)
        except Exception as e:
            self.collectives.note(e)
            return e, []
        if self.changed_between:
            changed = sorted(set(changed) | self.changed_between)
            self.changed_between = set()
        if changed and not self._warned_after_exchange:
            self._warned_after_exchange = True
            print(f"hotspare: rank {m.rank}: step {step} changed {', '.join(changed)} after its gradient exchange "
                  "(e.g. rank-0-only work that draws random numbers: iterating a DataLoader does). Its peers get "
                  "that state at the top of the next loop iteration; if this rank is lost before, inside that work, "
                  "its replacement starts without it and the report says so. To be sure, do such work at the top "
                  "of the loop body (before `with step:`), where a replacement runs it again, or inside "
                  "`with torch.random.fork_rng():`", file=sys.stderr, flush=True)
        return None, changed
