"""The in-process health checks of each step, as run by the worker (the arithmetic and the
verdicts are in runtime/vote.py, with the trade-offs).

* Every ``every`` steps a tiny all-reduce (the vote) carries each rank's parameter fingerprint
  and whether it wants to pause (live migration). It starts as the step begins and is judged
  before any optimizer steps, so a corrupt replica is caught before its update spreads.
* Every gradient bucket is scaled and scanned for NaN/Inf in one pass; the reduced buckets'
  sentinels are read before the update, and only when they are non-finite do the ranks compare
  their own flags to name the rank that produced the garbage.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import torch
import torch.distributed as dist

from hotspare.errors import PeerFailure, StateTrackingError
from hotspare.runtime.failures import Collectives
from hotspare.runtime.membership import Membership
from hotspare.runtime.vote import (HealthFault, VoteResult, fingerprint, nonfinite_verdict, row, scale_and_check,
                                   tally, word_views)

DEFAULT_VOTE_EVERY = 10   # steps between health votes; see runtime/vote.py for the trade-off


class HealthVote:
    def __init__(self, members: Membership, collectives: Collectives, pause_gen: Callable[[], int],
                 on_pause: Callable[[int], None], params: Callable[[], list[torch.Tensor]],
                 every: int = DEFAULT_VOTE_EVERY):
        self.members, self.collectives = members, collectives
        self._pause_gen, self._on_pause, self._param_source = pause_gen, on_pause, params
        self.every = every               # 0: vote without a fingerprint
        self._params: list[torch.Tensor] | None = None   # integer views of the parameters
        self._params_join = -1           # ... made in this join (a sync may replace tensors)
        self._vote: torch.futures.Future | None = None
        self._voting: tuple[int, bool] = (-1, False)     # (step, with fingerprint) of the vote in flight
        self.failed: VoteResult | None = None            # this step's failed vote
        self.tracking: str | None = None                 # a state transfer found state left untracked
        self.begin_step()

    def begin_step(self) -> None:
        self.failed = None
        self._nonfinite: torch.Tensor | None = None   # > 0 once this step's own gradients held NaN/Inf
        self.buckets: list[torch.Tensor] = []         # reduced buckets: their sentinels are read before the update
        self.check_s = 0.0      # this step's health checks on this rank (NaN scan, fingerprint)
        self.check_cpu = 0.0    # ... their CPU time (the wall time above includes waiting for a core)
        self.fp_s = 0.0         # ... of which the parameter fingerprint

    def _charge(self, t0: float, c0: float) -> None:
        self.check_s += time.perf_counter() - t0
        self.check_cpu += time.thread_time() - c0

    # ------------------------------------------------------------------ the vote
    def start(self, step: int) -> None:
        """On a vote step, launch the vote as the step begins: the parameters the step will use
        are final by now, and the tiny all-reduce runs while forward and backward compute; the
        last gradient bucket waits for it, so a verdict lands before any optimizer steps."""
        self._vote = None
        m = self.members
        due = step % (self.every or DEFAULT_VOTE_EVERY) == 0 or (step == m.verify_at and self.every > 0)
        if m.world_size == 1 and not m.broken and self._pause_gen() == m.generation:
            self._on_pause(step)         # a world of one (an elastic job shrunk to one) agrees alone
            return
        if not due or m.world_size < 2 or m.broken:
            return
        params = self._param_views()
        if not params:
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        with_fp = self.every > 0
        fp = fingerprint(views=params) if with_fp else 0
        self.fp_s = time.perf_counter() - t0
        self._voting = (step, with_fp)
        table = row(m.world_size, m.rank, fp, self._pause_gen() == m.generation)
        if params[0].device.type != "cpu":
            table = table.to(params[0].device)
        try:
            self._vote = dist.all_reduce(table, async_op=True).get_future()
        except Exception as e:       # the generation broke under us: the step fails like any collective
            self.collectives.note(e)
            self._vote = torch.futures.Future()
            self._vote.set_exception(PeerFailure(f"health vote could not start: {e}"[:300]))
        self._charge(t0, c0)

    def _param_views(self) -> list[torch.Tensor]:
        if self._params is None or self._params_join != self.members.joins:
            self._params = word_views(self._param_source())
            self._params_join = self.members.joins
        return self._params

    def take(self) -> torch.futures.Future | None:
        """The vote in flight, for the end of the gradient exchange to judge (or None)."""
        vote, self._vote = self._vote, None
        return vote

    def settle(self) -> BaseException | None:
        """Judge a vote no gradient bucket consumed; the error that fails the step, if any."""
        vote = self.take()
        if vote is None:
            return None
        try:
            self.judge(vote.wait()[0])
        except Exception as e:
            if not isinstance(e, (HealthFault, StateTrackingError)):
                self.collectives.note(e)
            return e
        return None

    def judge(self, table: torch.Tensor) -> None:
        """The summed vote table (same on every rank) -> this step's verdict; raises HealthFault."""
        step, with_fp = self._voting
        result = tally(table.cpu(), step, with_fp)
        if result.kind == "fingerprint" and self.every > 1:
            result = dataclasses.replace(result, detail=(
                f"{result.detail}; the previous vote was {self.every} steps earlier, so the "
                "corrupt values may have reached the other replicas' updates meanwhile "
                "(--fingerprint-every 1 catches them before)"))
        if result.failed and result.kind == "fingerprint" and step == self.members.verify_at:
            # One update after state moved to some ranks, and their parameters already differ
            # from their peers': what they received was not everything the step depends on.
            self.tracking = (f"ranks {', '.join(map(str, result.suspects)) or '?'} differ from their peers one "
                             f"step after state was transferred (generation {self.members.generation}): the script "
                             "keeps state that is not tracked (an LR scheduler, a loss scaler, a counter or a "
                             "generator the update depends on). Pass it to job.track(...); this is a bug in "
                             "the script, not a hardware fault")
            raise StateTrackingError(self.tracking)
        if result.failed:
            self.failed = result
            raise HealthFault(result)
        if result.pause:
            self._on_pause(step)         # a live migration leaves once this step is committed

    # ------------------------------------------------------------------ gradients
    def scan_bucket(self, flat: torch.Tensor, world_size: int) -> None:
        """Per gradient bucket, before it is reduced: scale it by 1/world and note whether this
        rank's own gradients hold NaN/Inf, in one pass (``vote.scale_and_check``, which also sets
        the bucket's NaN sentinel)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        if self._nonfinite is None:
            self._nonfinite = torch.zeros(1, dtype=torch.float32, device=flat.device)
        scale_and_check(flat, 1.0 / world_size, self._nonfinite)
        self._charge(t0, c0)

    def check_reduced(self, step: int) -> None:
        """Before the optimizer steps: NaN/Inf in the reduced gradients (their sentinels). Every
        rank sees the same reduced bits, so every rank stops here alike, with no exchange on
        healthy steps; only then do the ranks compare their own flags to name the culprit."""
        if not self.buckets:
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        buckets, self.buckets = self.buckets, []
        if buckets[0].device.type == "cpu":     # a float per bucket: a few microseconds, no tensors
            finite = all(math.isfinite(float(b[0])) for b in buckets)
        else:                                   # one sync on an accelerator
            finite = bool(torch.isfinite(torch.stack([b[0] for b in buckets])).all())
        self._charge(t0, c0)
        if finite:
            return
        m = self.members
        mine = self._nonfinite is not None and bool(self._nonfinite.item() > 0)
        flags = torch.zeros(m.world_size, dtype=torch.float32, device=buckets[0].device)
        flags[m.rank] = float(mine)
        try:
            dist.all_reduce(flags)
        except Exception as e:
            self.collectives.note(e)
            raise
        result = nonfinite_verdict(flags.cpu(), step)
        if result.failed:
            self.failed = result
            raise HealthFault(result)
        # Every rank's own gradients were non-finite: the script's numerics (e.g. a loss scaler
        # overflowing), deterministic on every replica; not a hardware fault, so let it through.
