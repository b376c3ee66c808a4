"""Device/node lifecycle: which state a device is in, and which moves between states are allowed.

Pure: no I/O, no clock (callers pass ``time``). ``registry.py`` persists the result.

States (``State``)::

    healthy      in service; takes work
    suspect      in service, but a signal is being watched (a rule said "watch")
    cordoned     takes no new work; what runs on it keeps running
    draining     its work is being moved off (live migration or failover to a spare)
    quarantined  no work; diagnostics run; back to service after passing them K times in a row
    retired      out of service for good (RMA); terminal

The table (``TABLE``), with who may make each move. An actor is ``"operator"``, ``"rule:<name>"``
or ``"diagnostics"``::

    healthy     -> suspect       rule, operator        a signal worth watching
    healthy     -> cordoned      rule, operator        stop new work
    suspect     -> healthy       rule, operator        the signal cleared
    suspect     -> cordoned      rule, operator        stop new work
    cordoned    -> healthy       operator              uncordon (rules never undo a cordon)
    cordoned    -> draining      rule, operator        move the work off
    draining    -> cordoned      operator              cancel the drain; still no new work
    draining    -> quarantined   rule, operator        the work is off; run diagnostics
    quarantined -> healthy       diagnostics           only after K passes in a row (default 2)
    quarantined -> retired       rule, operator, diagnostics
    healthy, suspect, cordoned, draining -> retired    operator

A move to the state the device is already in is refused too (the registry's convenience methods
treat a repeated cordon as a no-op instead). ``retired`` is terminal: a replaced device is a new
record.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Iterable, Mapping

from hotspare.errors import InvalidTransition

DEFAULT_PASSES_REQUIRED = 2


class State(str, enum.Enum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    CORDONED = "cordoned"
    DRAINING = "draining"
    QUARANTINED = "quarantined"
    RETIRED = "retired"

    def __str__(self) -> str:
        return self.value


MEANING = {
    State.HEALTHY: "in service; takes work",
    State.SUSPECT: "in service, but a signal is being watched",
    State.CORDONED: "takes no new work; what runs on it keeps running",
    State.DRAINING: "its work is being moved off to a spare",
    State.QUARANTINED: "no work; diagnostics run; back to service after K passes in a row",
    State.RETIRED: "out of service for good (RMA); terminal",
}

IN_SERVICE = frozenset({State.HEALTHY, State.SUSPECT})
# Out of service: Slurm drains the device's node while any device of the node is in one of these.
OUT_OF_SERVICE = frozenset({State.CORDONED, State.DRAINING, State.QUARANTINED, State.RETIRED})

OPERATOR, RULE, DIAGNOSTICS = "operator", "rule", "diagnostics"
ACTOR_KINDS = (OPERATOR, RULE, DIAGNOSTICS)


@dataclasses.dataclass(frozen=True)
class Move:
    src: State
    dst: State
    actors: frozenset[str]      # actor kinds allowed to make this move
    meaning: str


def _moves() -> tuple[Move, ...]:
    H, S, C, D, Q, R = State
    ro = frozenset({RULE, OPERATOR})
    op = frozenset({OPERATOR})
    moves = [
        Move(H, S, ro, "a signal worth watching"),
        Move(H, C, ro, "stop new work"),
        Move(S, H, ro, "the signal cleared"),
        Move(S, C, ro, "stop new work"),
        Move(C, H, op, "uncordon"),
        Move(C, D, ro, "move the work off"),
        Move(D, C, op, "cancel the drain; still no new work"),
        Move(D, Q, ro, "the work is off; run diagnostics"),
        Move(Q, H, frozenset({DIAGNOSTICS}), "passed diagnostics K times in a row"),
        Move(Q, R, frozenset(ACTOR_KINDS), "failed diagnostics or a repeat offender"),
    ]
    moves += [Move(s, R, op, "operator retires it") for s in (H, S, C, D)]
    return tuple(moves)


TABLE: tuple[Move, ...] = _moves()
_BY_EDGE: Mapping[tuple[State, State], Move] = {(m.src, m.dst): m for m in TABLE}


def parse_state(value: str | State) -> State:
    try:
        return State(value)
    except ValueError:
        raise InvalidTransition(f"unknown state {value!r}; states are "
                                f"{', '.join(s.value for s in State)}") from None


def actor_kind(actor: str) -> str:
    """``"operator" -> "operator"``, ``"rule:thermal" -> "rule"``, ``"diagnostics" -> "diagnostics"``."""
    if actor in (OPERATOR, DIAGNOSTICS):
        return actor
    if actor.startswith("rule:") and len(actor) > len("rule:"):
        return RULE
    raise InvalidTransition(f"unknown actor {actor!r}: use 'operator', 'diagnostics' or "
                            f"'rule:<name>' (e.g. 'rule:thermal-margin')")


def allowed_from(state: str | State) -> tuple[Move, ...]:
    """The moves the table allows out of ``state``, in table order."""
    src = parse_state(state)
    return tuple(m for m in TABLE if m.src is src)


def _who(actors: frozenset[str]) -> str:
    names = [k for k in ACTOR_KINDS if k in actors]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _describe_allowed(src: State) -> str:
    moves = allowed_from(src)
    if not moves:
        return f"{src} is terminal: nothing may leave it"
    parts = [f"{m.dst} (by {_who(m.actors)})" for m in moves]
    return f"from {src} the allowed moves are: " + ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class Transition:
    """One recorded move: from which state to which, when, why and by whom."""
    src: State
    dst: State
    time: float
    reason: str
    actor: str

    def to_json(self) -> dict[str, Any]:
        return {"from": self.src.value, "to": self.dst.value, "time": self.time,
                "reason": self.reason, "actor": self.actor}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Transition":
        return cls(State(d["from"]), State(d["to"]), float(d["time"]), str(d["reason"]), str(d["actor"]))


def transition(src: str | State, dst: str | State, *, actor: str, reason: str, time: float,
               device: str = "device", passes: int = 0,
               passes_required: int = DEFAULT_PASSES_REQUIRED) -> Transition:
    """Check one move against the table and return it as a ``Transition``; raise otherwise.

    ``passes`` is how many diagnostics runs the device has passed in a row since it entered
    quarantine; ``quarantined -> healthy`` needs ``passes >= passes_required``.
    Raises ``InvalidTransition`` whose message names the move, the state and what is allowed.
    """
    src, dst = parse_state(src), parse_state(dst)
    kind = actor_kind(actor)
    asked = f"cannot move {device} from {src} to {dst} (asked by {actor})"
    if not reason or not reason.strip():
        raise InvalidTransition(f"{asked}: a reason is required (say why, e.g. 'thermal margin -3C')")
    if src is dst:
        raise InvalidTransition(f"{asked}: it is already {src}; {_describe_allowed(src)}")
    move = _BY_EDGE.get((src, dst))
    if move is None:
        raise InvalidTransition(f"{asked}: not in the lifecycle table; {_describe_allowed(src)}")
    if kind not in move.actors:
        raise InvalidTransition(f"{asked}: only {_who(move.actors)} may make this move ({move.meaning}); "
                                f"{_describe_allowed(src)}")
    if (src, dst) == (State.QUARANTINED, State.HEALTHY) and passes < passes_required:
        raise InvalidTransition(f"{asked}: it has passed diagnostics {passes} time(s) in a row, "
                                f"{passes_required} are required")
    return Transition(src, dst, float(time), reason.strip(), actor)


def table_text(moves: Iterable[Move] = TABLE) -> str:
    """The table as aligned text, for ``--help`` and docs."""
    lines = []
    for m in moves:
        who = ", ".join(k for k in ACTOR_KINDS if k in m.actors)
        lines.append(f"  {m.src.value:<11} -> {m.dst.value:<11}  {who:<28} {m.meaning}")
    return "\n".join(lines)
