"""The coordinator's events: what reaches its queue, typed, each decoded once where it arrives.

Node agents' messages are decoded by the node endpoint (``coordinator.nodes``, with ``decode``
below), operator commands by the control endpoint (``coordinator.control``), telemetry by the
poller and stop signals by the launcher. The coordinator's one thread consumes them in order
(``Coordinator.handle``). ``t`` is when it happened, on the coordinator's clock (an agent's time
stamp, if sane, for what a worker said).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Union

from hotspare.errors import ProtocolError
from hotspare.health.types import TELEMETRY_METRICS, XIDS, Reading
from hotspare.protocol.channel import Channel
from hotspare.protocol.messages import FROM_WORKER, Message, validate


@dataclass(frozen=True)
class NodeConnected:
    """A node agent proved the job secret (``agent_hello``); not yet accepted."""
    node: str
    hello: Message
    channel: Channel
    t: float


@dataclass(frozen=True)
class NodeLost:
    """The link ``channel`` to ``node`` closed (the channel tells it from a later link of that name)."""
    node: str
    channel: Channel
    t: float


@dataclass(frozen=True)
class NodeResumed:
    """The agent of a node re-registered with a restarted coordinator service and replayed what
    it saw meanwhile: ``alive`` are the job's workers still running there."""
    node: str
    job: str
    alive: tuple[str, ...]
    t: float


@dataclass(frozen=True)
class NodeReleased:
    """The agent ended its part of job ``job`` (every worker gone) and is back in the service's
    pool; its link stays open."""
    node: str
    job: str
    t: float


@dataclass(frozen=True)
class AgentRefused:
    """A node agent could not carry out a command."""
    node: str
    command: str
    message: str
    t: float


@dataclass(frozen=True)
class DeviceChecked:
    """A node agent's verdict on one of its devices: admission or one quarantine diagnostics
    pass (``hotspare.agent.checks``). ``cancelled``: cut short, no verdict."""
    node: str
    device: str
    stage: str
    passed: bool
    cancelled: bool
    detail: str
    t: float


@dataclass(frozen=True)
class WorkerStarted:
    worker: str
    pid: int
    t: float


@dataclass(frozen=True)
class WorkerStopped:
    """The kernel reports the worker's process stopped (SIGSTOP) or continued."""
    worker: str
    stopped: bool
    t: float


@dataclass(frozen=True)
class WorkerExited:
    """The worker's process ended with ``code`` (negative: killed by that signal)."""
    worker: str
    code: int
    t: float


@dataclass(frozen=True)
class WorkerSaid:
    """A worker's own message (a ``FROM_WORKER`` type, schema-checked), relayed by its agent."""
    worker: str
    msg: Message
    t: float

    @property
    def type(self) -> str:
        return self.msg["type"]


@dataclass(frozen=True)
class FaultInjected:
    """An agent carried out an injected fault (only with the fault plug-in, hotspare.testing.faults)."""
    worker: str
    fault: str
    ident: int
    t: float


@dataclass(frozen=True)
class Readings:
    """A telemetry poll: the launcher's own (hotspare.health.telemetry.Poller), or a remote
    agent's of its host's devices (``node`` names it; the node endpoint checked they are its)."""
    readings: Any
    t: float
    node: str | None = None


@dataclass(frozen=True)
class OperatorCommand:
    """An authenticated operator command; ``reply`` takes the answer (a ``control_reply``)."""
    msg: Message
    origin: str
    reply: Callable[[Message], None]
    t: float


@dataclass(frozen=True)
class Preempt:
    """SIGTERM or SIGINT reached the launcher: stop after a last checkpoint, exit ``code``."""
    signal: str
    code: int
    t: float


@dataclass(frozen=True)
class DeviceLoaned:
    """The coordinator service gave ``hosts`` (``slots`` device slots) to job ``borrower``, short
    of devices for a lost rank; ``lender``: the preemptible job of lower priority that freed
    them ("" when they were idle in the pool), and how (``lender_gives``: "pause", it is paused
    whole; "shrink", an elastic lender goes on without its ranks on those hosts; "" from the
    pool). ``reason`` is the decision's (``hotspare.service.borrow``). The service queues it to
    both jobs; each report holds it."""
    borrower: str
    lender: str
    hosts: tuple[str, ...]
    slots: int
    borrower_priority: int
    lender_priority: int | None
    reason: str
    t: float
    lender_gives: str = ""


Event = Union[NodeConnected, NodeLost, NodeResumed, NodeReleased, AgentRefused, DeviceChecked, WorkerStarted, WorkerStopped, WorkerExited,
              WorkerSaid, FaultInjected, Readings, OperatorCommand, Preempt, DeviceLoaned]

# the events about one worker, which a node may send only for its own workers
WORKER_EVENTS = (WorkerStarted, WorkerStopped, WorkerExited, WorkerSaid, FaultInjected)


def _relay(node: str, msg: Message, t: Callable[[float], float]) -> WorkerSaid:
    inner = validate(msg["msg"])
    if inner["type"] not in FROM_WORKER or inner.get("worker", msg["worker"]) != msg["worker"]:
        raise ProtocolError(f"a relayed {inner['type']!r} is not a message worker {msg['worker']} may send")
    return WorkerSaid(msg["worker"], inner, t(msg["t"]))


# agent message type -> its event (``t(stamp)``: the agent's time stamp, checked; ``now``: arrival)
_DECODE: dict[str, Callable[[str, Message, Callable[[float], float], float], Event]] = {
    "relay": lambda node, m, t, now: _relay(node, m, t),
    "exited": lambda node, m, t, now: WorkerExited(m["worker"], m["code"], now),
    "started": lambda node, m, t, now: WorkerStarted(m["worker"], m["pid"], now),
    "stopped": lambda node, m, t, now: WorkerStopped(m["worker"], m["stopped"], now),
    "injected": lambda node, m, t, now: FaultInjected(m["worker"], m["fault"], m["id"], t(m["t"])),
    "refused": lambda node, m, t, now: AgentRefused(node, m["command"], m["message"], now),
    "checked": lambda node, m, t, now: _checked(node, m, now),
    "resumed": lambda node, m, t, now: NodeResumed(node, m["job"], tuple(m["alive"]), now),
    "released": lambda node, m, t, now: NodeReleased(node, m["job"], now),
    "readings": lambda node, m, t, now: _readings(node, m, t, now),
}


def _readings(node: str, msg: Message, stamp: Callable[[float], float], now: float) -> Readings:
    """A node's poll of its own devices (``hotspare.agent.telemetry``), schema-checked already:
    only telemetry metrics, time stamps near the coordinator's clock; no rank (the coordinator
    knows which rank runs where)."""
    out = []
    for item in msg["readings"]:
        unknown = sorted(set(item["metrics"]) - TELEMETRY_METRICS)
        if unknown:
            raise ProtocolError(f"reading of {item['device'][:64]!r}: {', '.join(k[:40] for k in unknown[:5])} "
                                "is not a telemetry metric")
        metrics = {k: tuple(v) if k == XIDS else v for k, v in item["metrics"].items()}
        out.append(Reading(item["device"], stamp(item["time"]), item["source"], metrics))
    return Readings(out, now, node)


def _checked(node: str, msg: Message, now: float) -> DeviceChecked:
    if msg["stage"] not in ("admission", "quarantine"):
        raise ProtocolError(f"a check verdict of stage {msg['stage']!r}: admission or quarantine")
    return DeviceChecked(node, msg["device"], msg["stage"], msg["passed"], msg["cancelled"], msg["detail"], now)


def decode(node: str, msg: Message, stamp: Callable[[float], float], now: float) -> Event:
    """The event an agent's (schema-checked) message stands for; ProtocolError if it is not an
    agent's message or not a worker's message inside a relay."""
    decoder = _DECODE.get(msg["type"])
    if decoder is None:
        raise ProtocolError("not an agent message")
    return decoder(node, msg, stamp, now)


# ---------------------------------------------------------------------------- the event schema
# One versioned record for everything the run tells the outside (the event stream that
# ``hotspare events`` reads, the metrics, the report's plot): the typed events above, serialised
# here, and the outcomes the observer (hotspare.observe) derives from the ledger. A record is
# ``{"schema": SCHEMA, "kind": ..., "t": ..., "data": {...}}``: ``kind`` is the event's class in
# snake case ("worker_exited") or one of OUTCOMES; ``t`` is wall-clock seconds (time.time());
# ``data`` holds the fields. A reader refuses a record of a newer schema. Live objects (a
# node's channel, an operator command's reply) and proofs are left out: a decoded event has None
# in their place.
SCHEMA = 1

# what the observer derives (hotspare/observe/observer.py documents each)
OUTCOMES = frozenset({"run_start", "run_end", "failure", "failover", "recovered", "unrecovered",
                      "generation", "migration", "checkpoint_fallback", "health_event", "devices",
                      "spares", "steps_repeated", "cluster"})

_EVENT_TYPES: tuple[type, ...] = Event.__args__        # type: ignore[attr-defined]
_LIVE = frozenset({"channel", "reply"})                # never serialised
_SECRET_KEYS = frozenset({"proof", "token", "secret"})


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))


EVENT_KINDS: dict[str, type] = {_snake(cls.__name__): cls for cls in _EVENT_TYPES}
KIND_OF: dict[type, str] = {cls: kind for kind, cls in EVENT_KINDS.items()}


def _scrub(msg: Any) -> Any:
    return {k: v for k, v in msg.items() if k not in _SECRET_KEYS} if isinstance(msg, dict) else msg


def _reading_to(r: Reading) -> dict[str, Any]:
    metrics = {k: list(v) if isinstance(v, tuple) else v for k, v in r.metrics.items()}
    return {"device": r.device, "time": r.time, "source": r.source, "metrics": metrics, "rank": r.rank}


def _reading_from(d: dict[str, Any]) -> Reading:
    metrics = {k: tuple(v) if isinstance(v, list) else v for k, v in d["metrics"].items()}
    return Reading(d["device"], float(d["time"]), d["source"], metrics, d.get("rank"))


def record(kind: str, t: float, data: dict[str, Any]) -> dict[str, Any]:
    """A record of the schema: a serialised event's or an outcome's (``kind`` in OUTCOMES)."""
    if kind not in EVENT_KINDS and kind not in OUTCOMES:
        raise ValueError(f"{kind!r} is neither an event nor an outcome of schema {SCHEMA}")
    return {"schema": SCHEMA, "kind": kind, "t": float(t), "data": data}


def to_record(event: Event) -> dict[str, Any]:
    """The schema's record of one typed event."""
    kind = KIND_OF.get(type(event))
    if kind is None:
        raise TypeError(f"{type(event).__name__} is not a coordinator event")
    data: dict[str, Any] = {}
    for f in dataclasses.fields(event):
        if f.name in _LIVE or f.name == "t":
            continue
        value = getattr(event, f.name)
        if isinstance(event, Readings) and f.name == "readings":
            value = [_reading_to(r) for r in value]
        elif f.name in ("hello", "msg"):
            value = _scrub(value)
        elif isinstance(value, tuple):
            value = list(value)
        data[f.name] = value
    return record(kind, event.t, data)


def check_record(rec: Any) -> dict[str, Any]:
    """``rec`` if it is a record this schema can read; ValueError saying why not."""
    if not isinstance(rec, dict) or not isinstance(rec.get("data"), dict) or not isinstance(rec.get("kind"), str):
        raise ValueError("not a hotspare event record (want {schema, kind, t, data})")
    version = rec.get("schema")
    if not isinstance(version, int) or version > SCHEMA:
        raise ValueError(f"event record of schema {version!r}: this hotspare reads schema {SCHEMA} and "
                         "older; upgrade hotspare to read it")
    if not isinstance(rec.get("t"), (int, float)):
        raise ValueError(f"event record {rec['kind']!r} without a time")
    return rec


def from_record(rec: dict[str, Any]) -> Event:
    """The typed event a record of an event stands for (None for its live objects); ValueError
    for an outcome's record or a record this schema cannot read."""
    check_record(rec)
    cls = EVENT_KINDS.get(rec["kind"])
    if cls is None:
        raise ValueError(f"{rec['kind']!r} is not a coordinator event (an outcome, or a newer kind)")
    data, kwargs = rec["data"], {}
    for f in dataclasses.fields(cls):
        if f.name in _LIVE:
            kwargs[f.name] = None
        elif f.name == "t":
            kwargs["t"] = float(rec["t"])
        elif cls is Readings and f.name == "readings":
            kwargs[f.name] = [_reading_from(r) for r in data[f.name]]
        elif (cls, f.name) in ((NodeResumed, "alive"), (DeviceLoaned, "hosts")):
            kwargs[f.name] = tuple(data[f.name])
        elif f.name in data:
            kwargs[f.name] = data[f.name]
    return cls(**kwargs)
