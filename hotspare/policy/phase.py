"""The job's lifecycle: which phase it is in, and which moves between phases are allowed.

Pure: no I/O. ``ClusterView.phase`` holds one; ``policy.view`` moves it, only along ``TABLE``::

    starting   -> running      every rank is ready: generation 1 forms
    starting   -> stopped      a startup failure, --resume with no usable checkpoint
    running    -> recovering   a member was lost, a step failed, a live migration paused
    running    -> finished     every rank finished its last step
    running    -> stopped      a bug, ranks that disagree, an operator or a scheduler stop
    recovering -> running      the next generation forms
    recovering -> finished     a migration asked for after the last step
    recovering -> stopped      no copy left and no checkpoint, capacity ran out
    finished, stopped          terminal

A move to the phase the job is already in is no move (``advance`` returns it unchanged).
"""
from __future__ import annotations

import enum


class JobPhase(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    FINISHED = "finished"
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value

    @property
    def over(self) -> bool:
        """The job ended (released or stopped): nothing is decided any more."""
        return self in (JobPhase.FINISHED, JobPhase.STOPPED)

    @property
    def active(self) -> bool:
        """A generation exists: members can be lost, steps fail."""
        return self in (JobPhase.RUNNING, JobPhase.RECOVERING)


TABLE: dict[JobPhase, frozenset[JobPhase]] = {
    JobPhase.STARTING: frozenset({JobPhase.RUNNING, JobPhase.STOPPED}),
    JobPhase.RUNNING: frozenset({JobPhase.RECOVERING, JobPhase.FINISHED, JobPhase.STOPPED}),
    JobPhase.RECOVERING: frozenset({JobPhase.RUNNING, JobPhase.FINISHED, JobPhase.STOPPED}),
    JobPhase.FINISHED: frozenset(),
    JobPhase.STOPPED: frozenset(),
}


class PhaseError(AssertionError):
    """A move the table does not allow: a bug in the policy, never a user mistake."""


def advance(current: JobPhase, to: JobPhase) -> JobPhase:
    """The phase after moving from ``current`` to ``to``; raise ``PhaseError`` if not allowed."""
    if to is current:
        return current
    if to not in TABLE[current]:
        raise PhaseError(f"job phase {current} -> {to} is not allowed (from {current}: "
                         f"{', '.join(sorted(p.value for p in TABLE[current])) or 'none, it is terminal'})")
    return to
