"""The loop around a training script's steps: the context managers of ``job.steps`` and
``job.step()``, and the top of each loop iteration, where what a failed attempt's iteration did
after its step block is undone (runtime/undo.py) before the step runs again (docs/CONTRACT.md,
"Where code may go").
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from hotspare.errors import ConfigError
from hotspare.runtime.contract import UntrackedWatch
from hotspare.runtime.objdigest import write_verify_digests
from hotspare.runtime.undo import Undo

# The loop's side of ``Job`` (runtime/job.py), which imports this module: typed loosely here so
# the import goes one way.
Job = Any


class Step(int):
    """A step number that is also the context manager guarding that step."""

    _job: Job

    def __new__(cls, job: Job, value: int) -> "Step":
        obj = super().__new__(cls, value)
        obj._job = job
        return obj

    def __enter__(self) -> "Step":
        self._job._enter_step(int(self))
        return self

    def __exit__(self, et, ev, tb) -> bool:
        return self._job._exit_step(int(self), ev)


class NextStep:
    """``with job.step():`` -- the next step, for loops the script drives itself (over a
    ``job.loader``). A failure inside is swallowed; as the loop takes its next batch, what the
    rest of the iteration did is undone, the failure is recovered, the batch is the failed
    step's batch again, and the next ``job.step()`` re-runs the step."""

    def __init__(self, job: Job):
        self._job = job
        self._step: int | None = None

    def __enter__(self) -> int:
        self._step = self._job._begin_context_step()
        self._job._enter_step(self._step)
        return self._step

    def __exit__(self, et, ev, tb) -> bool:
        # A recovered failure is swallowed; the recovery itself runs at the top of the loop's
        # next iteration (Job._resume_point), after the rest of this one, which it undoes.
        return self._job._exit_step(self._step, ev)


class IterationTop:
    """What the job keeps at the top of each loop iteration, between steps (the ``job.steps`` and
    ``job.epochs`` generators, a ``job.loader`` about to take the next step's batch)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.undo: Undo | None = None          # what a failed attempt's iteration must not keep
        self.rewind = False                    # per-rank state goes back to ``state`` too
        self.state: tuple[int, torch.Tensor] | None = None   # (step, per-rank state) at the iteration's top
        self.watch: UntrackedWatch | None = None  # untracked modules watched for change (contract.py)

    def failed(self, objects: dict[str, Any]) -> None:
        """A step failed before its update: the rest of its loop body still runs."""
        self.undo, self.rewind = Undo(objects), True

    def arrive(self, capture: bool = True) -> None:
        """After a failed attempt, undo what the rest of its iteration did (per-rank state back
        to this point of the failed iteration) and recover. Then note this rank's per-rank state
        here: what changed since its step committed reaches its peers with its next exchange,
        and the coordinator hears of it (runtime/rankstate.py, RowTable)."""
        job = self.job
        if self.undo is not None:
            undo, self.undo = self.undo, None
            undo.restore()
        job._recover_all()
        top, rewind, self.rewind = self.state, self.rewind, False
        if rewind and top is not None and top[0] == job.committed + 1:
            job.rankstate.restore(top[1], data_position=False)
            return
        if self.watch is not None and job.role == "active":
            try:
                if self.watch.check(job.committed + 1):
                    self.watch = None
            except ConfigError as e:
                self.watch = None
                job._contract_failed(e)
        if not capture:
            return
        now = job.rankstate.capture()
        own = job.rows.own_at_commit
        if own is not None and own.numel() == now.numel() and not torch.equal(own, now):
            job.protocol.changed_between.update(job.rankstate.changed_parts(own, now))
        self.state = (job.committed + 1, now)
        m = job.members
        # What this rank changed since its last exchange goes to the job's store before the step
        # begins (this rank alone: no collective), for a source to restore it from if it is lost
        # in this step (runtime/rankstate.py, RowTable.publish_top).
        if m is not None and m.rank is not None:
            try:
                job.rows.publish_top(m.store, m.rank, job.committed + 1, now)
            except Exception as e:      # noqa: BLE001 - the launcher's store is gone: the job is ending
                print(f"hotspare: rank {m.rank}: could not publish its state at the top of step "
                      f"{job.committed + 1}: {e}", file=sys.stderr, flush=True)


def finish_early_stop(job: Job) -> None:
    """The script ends. If it left the training loop early (an early-stopping ``break``) and
    did not crash, the job is done at its last committed step: report it like the end of
    ``job.steps`` (every rank must stop at the same step; the coordinator checks)."""
    if not job.managed:
        if job._left_early and not job._finished and not job._crashed:
            job._finished = True
            write_verify_digests(job)     # only under `hotspare verify`; no collective at exit
        return
    if not (job._left_early and not job._finished and not job._crashed and job.members is not None
            and job.members.rank is not None):
        return
    if job.top.rewind:
        # The `break` ran after a step that failed and was never committed: the replacement
        # re-runs that step and goes on, this rank cannot. Stop clearly, not differently.
        err = ConfigError(f"the script left the training loop right after step {job.committed + 1} failed "
                          "(it was being recovered): the early-stopping `break` ran for an attempt that was never "
                          "committed. Decide to stop at the top of the loop body (before `with step:`, from the "
                          "last committed step's metrics), where a re-run step cannot reach it first")
        print(f"hotspare: rank {job.rank}: {err}", file=sys.stderr, flush=True)
        job.protocol.report_crash(job.committed + 1, err)
        return
    job._resume_point()
    job._finish_all()


__all__ = ["Step", "NextStep", "IterationTop", "finish_early_stop"]
