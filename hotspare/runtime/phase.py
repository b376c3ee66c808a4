"""The worker's failover lifecycle: its phases, what moves it, and what each move makes it do.

Pure: no torch, no sockets, no clock. ``transition(state, event)`` returns the next state and
the effects to carry out, in order; ``runtime/driver.py`` carries them out (``Effect`` ->
I/O) and feeds back the events they produce. The coordinator's side is ``policy/phase.py``.
The table (``TABLE``; docs/ARCHITECTURE.md draws it)::

    waiting     -> joining      an order names this worker's generation (a spare: its rank)
    waiting     -> released     a spare released unused
    waiting     -> stopped      a first rank released before the job started
    joining     -> stepping     the group is built and the state synced
    joining     -> recovering   a peer failed while joining: report it, await the next order
    stepping    -> recovering   a step failed (a peer lost, the health vote against it)
    stepping    -> paused       a live migration: the agreed step is committed
    stepping    -> done         the last step is committed: report the digests
    recovering  -> joining      the next generation's order
    recovering  -> stopped      the coordinator stopped the job instead
    paused      -> joining      the next generation's order (this rank stays)
    paused      -> handing_off  this rank is the one migrated: its state goes to the spare
    paused      -> stopped      the coordinator stopped the job instead
    done        -> joining      a peer failed in the last step: a recovery needs this rank
    done        -> released     the job is over
    handing_off, released, stopped   terminal (the process exits, or the script returns)

Two events move no phase and may come from the control channel's reader thread at any time:
``Aborted`` (the coordinator aborted a generation: its group is torn down at once, which frees
a rank blocked in a collective; remembered, since the abort can overtake the group being built)
and ``PauseAsked`` (a live migration asks this generation to pause; the next health vote carries
it). Everything else happens on the training thread.

A failed step is recovered at the next *resume point* (the top of the next loop iteration),
after the rest of the failed iteration ran and was undone (runtime/iteration.py): ``StepFailed``
only aborts the group (so the peers blocked on this rank are freed now); ``ResumePoint`` tears
down (transfers in flight end), rolls back, reports and waits.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Union


class WorkerPhase(enum.Enum):
    WAITING = "waiting"
    JOINING = "joining"
    STEPPING = "stepping"
    RECOVERING = "recovering"
    PAUSED = "paused"
    HANDING_OFF = "handing_off"
    DONE = "done"
    RELEASED = "released"
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value

    @property
    def awaiting(self) -> bool:
        """Between generations: the next thing to happen is an order from the coordinator."""
        return self in (WorkerPhase.WAITING, WorkerPhase.RECOVERING, WorkerPhase.PAUSED, WorkerPhase.DONE)


P = WorkerPhase
TABLE: dict[WorkerPhase, frozenset[WorkerPhase]] = {
    P.WAITING: frozenset({P.JOINING, P.RELEASED, P.STOPPED}),
    P.JOINING: frozenset({P.STEPPING, P.RECOVERING}),
    P.STEPPING: frozenset({P.RECOVERING, P.PAUSED, P.DONE}),
    P.RECOVERING: frozenset({P.JOINING, P.STOPPED}),
    P.PAUSED: frozenset({P.JOINING, P.HANDING_OFF, P.STOPPED}),
    P.DONE: frozenset({P.JOINING, P.RELEASED}),
    P.HANDING_OFF: frozenset(),
    P.RELEASED: frozenset(),
    P.STOPPED: frozenset(),
}


class WorkerPhaseError(AssertionError):
    """An event the worker's phase does not allow: a bug in the runtime, never a user mistake."""


# ---------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class Order:
    """The coordinator's ``generation`` or ``handoff`` order (the message, as received)."""
    msg: dict[str, Any]

    @property
    def gen(self) -> int:
        return int(self.msg["gen"])

    @property
    def handoff(self) -> bool:
        return self.msg["type"] == "handoff"


@dataclass(frozen=True)
class Released:
    reason: str = ""


@dataclass(frozen=True)
class CheckpointAsked:
    """The job is stopping: leave a checkpoint of the committed state (between generations), in
    the worker's own checkpoint directory (its contract's: the one place that setting lives)."""


@dataclass(frozen=True)
class Joined:
    gen: int
    rank: int
    world: int


@dataclass(frozen=True)
class JoinFailed:
    """A peer failed while this rank joined (built the group, synced state)."""
    error: str
    committed: int


@dataclass(frozen=True)
class StepFailed:
    """A step (or the state sync before the first) failed for a reason a recovery fixes."""
    step: int
    reason: str
    health: dict[str, Any] | None = None   # the health vote's verdict, when it failed the step
    abort: bool = True      # abort the group now: peers may be blocked on this rank (not after a
                            # failed vote: every rank failed it alike, nobody is blocked)


@dataclass(frozen=True)
class PauseAgreed:
    """The health vote of ``step`` carried a live migration's pause: leave once it is committed."""
    step: int


@dataclass(frozen=True)
class ResumePoint:
    """The training thread is at the top of a loop iteration, between steps; ``may_pause``:
    a live migration may leave here (not after the last step, nor inside the loop's undo)."""
    committed: int
    may_pause: bool = True


@dataclass(frozen=True)
class Finished:
    """The last step is committed; ``fields``: what the done report says (step, digests)."""
    fields: dict[str, Any]


@dataclass(frozen=True)
class Aborted:
    upto: int


@dataclass(frozen=True)
class PauseAsked:
    gen: int


Event = Union[Order, Released, CheckpointAsked, Joined, JoinFailed, StepFailed, PauseAgreed, ResumePoint,
              Finished, Aborted, PauseAsked]


# ---------------------------------------------------------------------------------- effects
@dataclass(frozen=True)
class AbortGroup:
    """Abort the group of every generation up to ``upto`` (thread-safe; frees blocked peers)."""
    upto: int


@dataclass(frozen=True)
class Rollback:
    """Put back what the failed ``step`` touched, and reset the gradient-sync wrappers."""
    step: int


@dataclass(frozen=True)
class Teardown:
    pass


@dataclass(frozen=True)
class Report:
    """Tell the coordinator: ``failed``, ``paused`` or ``done`` (with ``fields``)."""
    type: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class AwaitOrder:
    """Block for the next order; produces ``Order``, ``Released`` or ``CheckpointAsked``."""


@dataclass(frozen=True)
class Checkpoint:
    pass


@dataclass(frozen=True)
class Join:
    """Build the order's group and sync state; produces ``Joined`` or ``JoinFailed``."""
    msg: dict[str, Any]


@dataclass(frozen=True)
class HandOff:
    """Send this rank's own state to the spare taking its place, then exit the process."""
    msg: dict[str, Any]


@dataclass(frozen=True)
class Stop:
    """The coordinator ended the job while this rank needed it: raise ``JobFailed(reason)``."""
    reason: str


@dataclass(frozen=True)
class ExitSpare:
    """A spare released unused: the script's atexit handlers run, then the process exits 0."""


Effect = Union[AbortGroup, Rollback, Teardown, Report, AwaitOrder, Checkpoint, Join, HandOff, Stop, ExitSpare]


# ---------------------------------------------------------------------------------- state
@dataclass(frozen=True)
class WorkerState:
    phase: WorkerPhase = WorkerPhase.WAITING
    role: str = "active"              # "active" (a first rank) or "spare"
    generation: int = 0
    rank: int | None = None
    world: int = 1
    failure: StepFailed | None = None   # the failed step a resume point recovers
    pause_at: int | None = None       # a live migration pauses once this step is committed
    aborted_upto: int = 0             # newest generation the coordinator aborted
    pause_gen: int = -1               # newest generation a live migration asked to pause
    taken_gen: int = 0                # newest generation (or hand-off) order taken

    @property
    def recovering(self) -> bool:
        """A failure waits for the next resume point."""
        return self.failure is not None


STOPPED_DURING = {
    WorkerPhase.RECOVERING: "the coordinator stopped the job during recovery (see the launcher's output)",
    WorkerPhase.PAUSED: "the coordinator stopped the job during a live migration",
    WorkerPhase.WAITING: "the coordinator released this worker before the job started",
}


def _move(state: WorkerState, to: WorkerPhase, **changes: Any) -> WorkerState:
    if to is not state.phase and to not in TABLE[state.phase]:
        raise WorkerPhaseError(f"worker phase {state.phase} -> {to} is not allowed (from {state.phase}: "
                               f"{', '.join(sorted(p.value for p in TABLE[state.phase])) or 'none, it is terminal'})")
    return dataclasses.replace(state, phase=to, **changes)


def _refuse(state: WorkerState, event: Event) -> WorkerPhaseError:
    return WorkerPhaseError(f"{type(event).__name__} in worker phase {state.phase}")


def transition(state: WorkerState, event: Event) -> tuple[WorkerState, list[Effect]]:
    """The worker's next state and what to do, for ``event`` in ``state``."""
    phase = state.phase
    # ---- from the reader thread, in any phase
    if isinstance(event, Aborted):
        upto = max(state.aborted_upto, event.upto)
        return dataclasses.replace(state, aborted_upto=upto), [AbortGroup(upto)]
    if isinstance(event, PauseAsked):
        return dataclasses.replace(state, pause_gen=max(state.pause_gen, event.gen)), []
    # ---- between generations
    if isinstance(event, (Order, Released, CheckpointAsked)):
        if not phase.awaiting:
            raise _refuse(state, event)
        if isinstance(event, CheckpointAsked):
            return state, [Checkpoint(), AwaitOrder()]
        if isinstance(event, Released):
            if phase is P.DONE:
                return _move(state, P.RELEASED), []
            if phase is P.WAITING and state.role == "spare":
                return _move(state, P.RELEASED), [ExitSpare()]
            return _move(state, P.STOPPED), [Stop(STOPPED_DURING[phase])]
        if event.gen <= state.taken_gen:      # a repeat (a restarted coordinator's), or stale
            return state, [AwaitOrder()]
        if event.handoff:
            if phase is not P.PAUSED:
                raise _refuse(state, event)
            return _move(state, P.HANDING_OFF, taken_gen=event.gen), [HandOff(event.msg)]
        return _move(state, P.JOINING, taken_gen=event.gen, failure=None, pause_at=None), [Join(event.msg)]
    # ---- joining
    if isinstance(event, Joined):
        if phase is not P.JOINING:
            raise _refuse(state, event)
        return _move(state, P.STEPPING, generation=event.gen, rank=event.rank, world=event.world), []
    if isinstance(event, JoinFailed):
        if phase is not P.JOINING:
            raise _refuse(state, event)
        return _move(state, P.RECOVERING), [
            Teardown(), Report("failed", {"committed": event.committed, "error": f"during join: {event.error}"[:300]}),
            AwaitOrder()]
    # ---- stepping
    if isinstance(event, StepFailed):
        if phase is not P.STEPPING:
            raise _refuse(state, event)
        if state.failure is not None:         # already failed; the first reason stands
            return state, []
        return dataclasses.replace(state, failure=event), [AbortGroup(state.generation)] if event.abort else []
    if isinstance(event, PauseAgreed):
        if phase is not P.STEPPING:
            raise _refuse(state, event)
        return dataclasses.replace(state, pause_at=event.step), []
    if isinstance(event, ResumePoint):
        if phase is not P.STEPPING:
            raise _refuse(state, event)
        failure = state.failure
        if failure is not None:
            fields: dict[str, Any] = {"committed": event.committed, "error": failure.reason or ""}
            if failure.health is not None:
                fields["health"] = failure.health
            # torn down first: transfers in flight end (a sharded job's buddy snapshots), then
            # what the failed step touched is put back
            return _move(state, P.RECOVERING, failure=None, pause_at=None), [
                Teardown(), Rollback(failure.step), Report("failed", fields), AwaitOrder()]
        if event.may_pause and state.pause_at is not None and event.committed >= state.pause_at:
            return _move(state, P.PAUSED, pause_at=None), [
                Teardown(), Report("paused", {"committed": event.committed}), AwaitOrder()]
        return state, []
    if isinstance(event, Finished):
        if phase is not P.STEPPING or state.failure is not None:
            raise _refuse(state, event)
        # A finished rank keeps its group until released or joined elsewhere: a peer may still
        # be receiving its share of the last step's collectives.
        return _move(state, P.DONE), [Report("done", dict(event.fields)), AwaitOrder()]
    raise _refuse(state, event)


__all__ = ["WorkerPhase", "WorkerState", "TABLE", "WorkerPhaseError", "transition", "Event", "Effect",
           "Order", "Released", "CheckpointAsked", "Joined", "JoinFailed", "StepFailed", "PauseAgreed",
           "ResumePoint", "Finished", "Aborted", "PauseAsked", "AbortGroup", "Rollback", "Teardown", "Report",
           "AwaitOrder", "Checkpoint", "Join", "HandOff", "Stop", "ExitSpare", "STOPPED_DURING"]
