"""The facts the coordinator's policy is told (signals), each a small frozen dataclass.

The coordinator turns what its node agents, the telemetry poller and operators say into these
(``hotspare.coordinator.translate``), once; ``policy.view.observe`` records them and
``policy.decide.decide`` acts on them. ``FailureCause`` names why a rank was lost, one name from the
detection to the report.
"""
from __future__ import annotations

import enum
import signal as _signal
from dataclasses import dataclass
from typing import Union

from hotspare.policy.hang import RankActivity


class FailureCause(enum.Enum):
    """Why a member was lost: what its failure record says (``kind`` in the report)."""
    KILLED = "killed"                   # by a signal: the record names it (SIGKILL, SIGSEGV...)
    EXITED = "exited"                   # it ended by itself with a non-zero status
    EXCEPTION = "exception"             # its step raised: the traceback reached the coordinator
    HANG = "hang"                       # fenced by the hang detector
    HEALTH = "health"                   # fenced by a health rule: the record names the rule
    NODE_LOST = "node lost"             # lost with its node agent's link
    COLLECTIVE = "collective error"     # a collective failed although nobody died


def exit_cause(code: int) -> FailureCause:
    """A process's exit status (negative: killed by that signal) as a cause."""
    return FailureCause.KILLED if code < 0 else FailureCause.EXITED


def signal_name(code: int) -> str:
    """The name of the signal that ended a process with status ``code`` (< 0)."""
    try:
        return _signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def describe_exit(code: int) -> str:
    """In words, for the log: "was killed by SIGKILL", "exited with code 3"."""
    return f"was killed by {signal_name(code)}" if code < 0 else f"exited with code {code}"


@dataclass(frozen=True)
class WorkerReady:
    worker: str
    role: str                  # "active" (rank known from launch) or "spare"
    rank: int | None = None


@dataclass(frozen=True)
class WorkerExited:
    worker: str
    code: int                  # the exit status; negative: killed by that signal
    description: str = ""      # in words, for the reason (e.g. "was lost with node a")
    node_lost: bool = False    # lost with its node agent's link, not seen to exit by itself
    spare: bool = False        # started as a spare (else as one of the initial ranks)


@dataclass(frozen=True)
class StepFailed:
    worker: str
    rank: int
    gen: int
    committed: int
    error: str = ""


@dataclass(frozen=True)
class Crashed:
    worker: str
    rank: int
    gen: int
    step: int
    error: str
    traceback: str = ""
    refused: bool = False       # the job cannot run as configured (e.g. host RAM): stop, do not fail over


@dataclass(frozen=True)
class Done:
    worker: str
    rank: int
    gen: int
    step: int
    digest: str


@dataclass(frozen=True)
class Checkpointed:
    """A persistent checkpoint of ``step`` finished writing at ``path`` (the last resort)."""
    step: int
    path: str


@dataclass(frozen=True)
class Tick:
    """Periodic: the heartbeat picture the hang detector needs (see policy/hang.py)."""
    activity: tuple[RankActivity, ...]
    stalled_for: float         # seconds since the last committed step (or the generation formed)
    recovering_for: float      # seconds since this recovery began (0 when running)
    limit: float               # the hang threshold now


@dataclass(frozen=True)
class HealthVerdict:
    """The health rules judged the device under ``rank`` (see hotspare/health/rules.py)."""
    device: str
    rank: int | None
    action: str                # hotspare.health.types.ACTIONS
    reason: str
    trust_memory: bool = True  # False: the rank's state must come from a replica
    rule: str = ""
    step: int | None = None    # in-process signals (fingerprint vote, NaN): the step they failed
    worker: str = ""


@dataclass(frozen=True)
class Paused:
    """A rank left its generation at a step boundary, as a live migration asked."""
    worker: str
    rank: int
    gen: int
    committed: int


Signal = Union[WorkerReady, WorkerExited, StepFailed, Crashed, Done, Checkpointed, Tick, HealthVerdict, Paused]
