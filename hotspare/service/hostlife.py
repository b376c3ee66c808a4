"""A host's lifecycle in the coordinator service: which phase its agent is in, and which moves
between phases are allowed. Pure: no I/O, no locks (``Service`` applies it under its lock and
writes what it returns to the database and the log).

::

    gone      -> idle        its agent registered (or registered again after its link closed)
    gone      -> busy        its agent re-registered naming a job this service resumes
    idle      -> reserved    placement picked it for a job whose rendezvous store is starting
    idle      -> busy        a spare host given straight to a running job short of spares
    reserved  -> busy        the placement was committed: the job's ``assign`` goes to the agent
    reserved  -> idle        the job was cancelled while its store started: never told, back
    busy      -> releasing   its job ended and its agent has not yet said ``released``; or its
                             running elastic job lends it by shrinking (``Lent``): the agent ends
                             that job's workers there and says ``released``
    busy      -> idle        its job ended and its agent said ``released`` (its workers are gone)
    releasing -> idle        the agent said ``released`` for that job
    releasing -> gone        it did not within ``RELEASE_WAIT_S``: the service closes its link (an
                             agent that cannot end its part of a job must not take another; it
                             ends its workers when it finds its job not resumed, and leaves)
    any       -> gone        its link closed

Only an ``idle`` host is placed. What the next job's setup reads of a host (its devices, its
agent's pid, whether it carries out device faults) is the ``Agent`` it registered with, kept
for as long as that link lives: a job's end never rebuilds it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Union

RELEASE_WAIT_S = 30.0     # after its job ended, an agent that has not said `released` by then is cut off


class HostPhase(enum.Enum):
    GONE = "gone"
    IDLE = "idle"
    RESERVED = "reserved"
    BUSY = "busy"
    RELEASING = "releasing"

    def __str__(self) -> str:
        return self.value


TABLE: dict[HostPhase, frozenset[HostPhase]] = {
    HostPhase.GONE: frozenset({HostPhase.IDLE, HostPhase.BUSY}),
    HostPhase.IDLE: frozenset({HostPhase.RESERVED, HostPhase.BUSY, HostPhase.GONE}),
    HostPhase.RESERVED: frozenset({HostPhase.BUSY, HostPhase.IDLE, HostPhase.GONE}),
    HostPhase.BUSY: frozenset({HostPhase.RELEASING, HostPhase.IDLE, HostPhase.GONE}),
    HostPhase.RELEASING: frozenset({HostPhase.IDLE, HostPhase.GONE}),
}


class HostPhaseError(AssertionError):
    """A move the table does not allow: a bug in the service, never a user mistake."""


@dataclass(frozen=True)
class Agent:
    """What a host's agent said of itself when it registered: all a job's setup reads of it."""
    name: str
    devices: tuple[str, ...]
    spare: bool
    pid: int
    device_faults: bool

    @classmethod
    def from_hello(cls, hello: dict[str, Any]) -> "Agent":
        """From an ``agent_hello`` (schema-checked already: node, pid, devices, device_faults)."""
        spare = hello.get("spare", False)
        if not isinstance(spare, bool):
            raise ValueError("'spare' must be true or false")
        return cls(str(hello["node"]), tuple(str(d) for d in hello["devices"]), spare, int(hello["pid"]),
                   bool(hello["device_faults"]))

    def hello(self, devices: list[str]) -> dict[str, Any]:
        """The hello a job's coordinator takes this host in with, given ``devices`` of its slots."""
        return {"node": self.name, "pid": self.pid, "devices": list(devices), "device_faults": self.device_faults,
                "spare": self.spare}


@dataclass(frozen=True)
class HostState:
    phase: HostPhase = HostPhase.GONE
    job: str | None = None          # the job it is reserved for, works for, or is being released from
    since: float = 0.0              # when it entered this phase

    def describe(self) -> str:
        """As the database and `hotspare status` show it."""
        if self.phase is HostPhase.BUSY:
            return f"job {self.job}"
        if self.phase is HostPhase.RESERVED:
            return f"reserved for {self.job}"
        if self.phase is HostPhase.RELEASING:
            return f"releasing ({self.job} ended)"
        return self.phase.value


# ---------------------------------------------------------------------- what happens to a host
@dataclass(frozen=True)
class Registered:
    """Its agent registered; ``job``: the running job it resumes after a restart (None: none)."""
    job: str | None = None


@dataclass(frozen=True)
class Reserved:
    job: str


@dataclass(frozen=True)
class Unreserved:
    """The job it was reserved for will not start (cancelled while its store started)."""
    job: str


@dataclass(frozen=True)
class Assigned:
    job: str


@dataclass(frozen=True)
class JobEnded:
    """``job`` ended; ``released``: its agent already said ``released`` for it."""
    job: str
    released: bool


@dataclass(frozen=True)
class Released:
    """The agent said ``released`` for ``job``: its part of the job is over, its workers gone."""
    job: str


@dataclass(frozen=True)
class Lent:
    """Its running ``job`` (elastic) gives it up by shrinking: its agent is asked to end the
    job's workers there; once it says ``released`` the host is idle (for the borrower)."""
    job: str


@dataclass(frozen=True)
class Tick:
    """Time passes: a host releasing for longer than ``RELEASE_WAIT_S`` is cut off."""


@dataclass(frozen=True)
class LinkLost:
    pass


HostEvent = Union[Registered, Reserved, Unreserved, Assigned, JobEnded, Lent, Released, Tick, LinkLost]


def _move(state: HostState, to: HostPhase, job: str | None, now: float) -> HostState:
    if to not in TABLE[state.phase]:
        raise HostPhaseError(f"host phase {state.phase} -> {to} is not allowed (from {state.phase}: "
                             f"{', '.join(sorted(p.value for p in TABLE[state.phase]))})")
    return HostState(to, job, now)


def transition(state: HostState, event: HostEvent, now: float) -> tuple[HostState, str]:
    """The host's state after ``event`` at ``now``, and why, in words. An event about another
    job than the host's (a late ``released``, say) leaves it as it is and says so; a move the
    table does not allow is a ``HostPhaseError``."""
    phase, job = state.phase, state.job
    if isinstance(event, LinkLost):
        if phase is HostPhase.GONE:
            return state, "its link was gone already"
        return _move(state, HostPhase.GONE, None, now), "its link closed"
    if isinstance(event, Registered):
        if event.job is not None:
            return _move(state, HostPhase.BUSY, event.job, now), f"re-registered for its job {event.job}"
        return _move(state, HostPhase.IDLE, None, now), "registered: in the pool"
    if isinstance(event, Reserved):
        return _move(state, HostPhase.RESERVED, event.job, now), f"reserved for {event.job}"
    if isinstance(event, Assigned):
        if phase not in (HostPhase.IDLE, HostPhase.RESERVED) or (phase is HostPhase.RESERVED and job != event.job):
            raise HostPhaseError(f"host {state.describe()} assigned to {event.job}: only an idle host, or one "
                                 "reserved for that job, is")
        return _move(state, HostPhase.BUSY, event.job, now), f"works for {event.job}"
    if isinstance(event, Tick):
        if phase is HostPhase.RELEASING and now - state.since >= RELEASE_WAIT_S:
            return (_move(state, HostPhase.GONE, None, now),
                    f"its agent did not say released for {job} within {RELEASE_WAIT_S:.0f} s: its link is closed")
        return state, "nothing due"
    if job != event.job:
        return state, f"{type(event).__name__.lower()} for {event.job} while {state.describe()}: ignored"
    if isinstance(event, Unreserved):
        if phase is not HostPhase.RESERVED:
            return state, f"not reserved ({state.describe()}): nothing to undo"
        return _move(state, HostPhase.IDLE, None, now), f"{job} will not start: back in the pool"
    if isinstance(event, JobEnded):
        if phase is not HostPhase.BUSY:
            return state, f"{job} ended while {state.describe()}: nothing to do"
        if event.released:
            return _move(state, HostPhase.IDLE, None, now), f"{job} ended and its agent released: back in the pool"
        return _move(state, HostPhase.RELEASING, job, now), f"{job} ended: waiting for its agent to release"
    if isinstance(event, Lent):
        if phase is not HostPhase.BUSY:
            return state, f"lent by {job} while {state.describe()}: nothing to do"
        return (_move(state, HostPhase.RELEASING, job, now),
                f"{job} shrinks to lend it: waiting for its agent to release")
    if isinstance(event, Released):
        if phase is HostPhase.BUSY:
            return state, f"released {job} while it runs: the job's coordinator handles it"
        if phase is not HostPhase.RELEASING:
            return state, f"released {job} while {state.describe()}: ignored"
        return _move(state, HostPhase.IDLE, None, now), f"released {job}: back in the pool"
    raise TypeError(f"not a host event: {event!r}")
