"""What the coordinator's policy asks for (actions), each a small frozen dataclass.

``decide`` returns them, the coordinator's executor (``hotspare.coordinator.execute``) carries them
out, and ``policy.view.apply`` records their effect on the view.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from hotspare.policy.signals import FailureCause


@dataclass(frozen=True)
class FormGeneration:
    gen: int
    members: dict[int, str]    # rank -> worker
    target: int                # committed step every rank adopts
    source: int
    receivers: tuple[int, ...]
    replacements: dict[int, str] = field(default_factory=dict)   # rank -> spare that takes it
    restore: str | None = None  # every rank loads this checkpoint instead of receiving from a peer
    handoff_from: str | None = None  # live migration: this old worker sends its state to the spare
    # an elastic job (policy/shrink.py): virtual rank -> physical rank from this generation on, and
    # before it (the rows of per-rank state the source holds are laid out by ``before``)
    placement: tuple[int, ...] | None = None
    before: tuple[int, ...] | None = None
    regrow: bool = False       # a virtual rank moves back onto a spare: no failure to record


@dataclass(frozen=True)
class AbortGeneration:
    gen: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Fence:
    """Kill these ranks' processes for sure (process group, SIGKILL) before reassigning them."""
    ranks: tuple[int, ...]
    reason: str
    cause: FailureCause = FailureCause.HANG    # HANG, or HEALTH with the rule that fired
    rule: str = ""


@dataclass(frozen=True)
class CheckpointNow:
    """Ask a surviving rank to write a synchronous checkpoint before the job stops."""
    rank: int
    reason: str


@dataclass(frozen=True)
class Pause:
    """Live migration, first half: every rank of ``gen`` leaves it at the next step boundary
    (agreed inside the gradient exchange, so all stop after the same step); then ``rank``
    hands its state to ``spare`` directly, its memory still being good."""
    gen: int
    rank: int
    spare: str
    device: str
    reason: str
    rule: str = ""


@dataclass(frozen=True)
class Regrow:
    """An elastic job grows back: every rank of ``gen`` leaves it at the next step boundary (as
    for a ``Pause``), then virtual rank ``vrank`` moves onto ``spare`` (policy/shrink.py)."""
    gen: int
    vrank: int
    spare: str
    placement: tuple[int, ...]       # virtual rank -> physical rank after the move
    reason: str


@dataclass(frozen=True)
class Cordon:
    """Take a device out of service: no new work; drained, then quarantine diagnostics."""
    device: str
    reason: str
    rule: str = ""
    retire: bool = False       # a repeat offender: retire it once drained instead of diagnosing


@dataclass(frozen=True)
class StartSpares:
    count: int


@dataclass(frozen=True)
class Release:
    reason: str


@dataclass(frozen=True)
class Stop:
    code: int
    message: str


Action = Union[FormGeneration, AbortGeneration, Fence, CheckpointNow, StartSpares, Release, Stop, Pause, Cordon,
               Regrow]
