"""Control messages: one JSON object per line, versioned, validated on arrival.

Only small metadata travels here (tensors go peer to peer over torch.distributed), and nothing
received is ever unpickled: a message is plain JSON checked against the schema below. A message
of another protocol version, an unknown type, or a missing/mistyped field is refused with a
``ProtocolError`` that names the problem; the sender's connection is dropped, the job goes on.
Only while connecting does a client take a listener's challenge and refusal of any version
(``EVERY_VERSION``), so that a version mismatch is refused with both versions named.
Numbers must be finite (JSON's NaN/Infinity and overflowing literals are refused) and the
fields named in ``RANGES`` within their range; nested fields (``metrics``, ``timings``,
``health``, lists) are checked by type too (``NESTED``). Who may send which message is checked
where it arrives (``hotspare.protocol.auth``, the agent, the node endpoint).
"""
from __future__ import annotations

import json
import math
from typing import Any, Callable

from hotspare.errors import ProtocolError

VERSION = 1
# The form of these messages is the same in every protocol version: a client reads a listener's
# challenge and refusal whatever version the listener speaks, so that a listener of another
# version can read the client's hello and refuse it with a reason the client can show
# (hotspare.protocol.auth). Every other message must be of this VERSION.
EVERY_VERSION = frozenset({"challenge", "refused"})
MAX_LINE = 4 * 1024 * 1024   # tracebacks can be long; anything bigger is not a control message

_INT = (int,)
_NUM = (int, float)
_STR = (str,)
_OPT_NUM = (int, float, type(None))
_OPT_INT = (int, type(None))
_OPT_STR = (str, type(None))
_BOOL = (bool,)
_LIST = (list,)
_DICT = (dict,)

# type -> {field: accepted python types}. Extra fields are allowed (forward compatible);
# missing or mistyped required fields are not.
SCHEMA: dict[str, dict[str, tuple[type, ...]]] = {
    # listener -> client, first thing on every connection (hotspare.protocol.auth)
    "challenge": {"nonce": _STR},
    # worker -> agent
    "hello": {"worker": _STR, "pid": _INT, "role": _STR, "proof": _STR},
    "ready": {"worker": _STR, "committed": _INT},
    # "step", "joining" and "transfer" are fault triggers: while faults are armed ("watch") they
    # carry a "wait" sequence number, and the worker goes on only once the agent answers "go"
    # with it, so an injected fault lands exactly there (hotspare.testing.faults)
    "step": {"gen": _INT, "rank": _INT, "step": _INT},        # only while the agent watches steps
    "reducing": {"gen": _INT, "rank": _INT, "step": _INT},    # the answer to a probe
    "joining": {"gen": _INT, "rank": _INT},
    "transfer": {"gen": _INT, "rank": _INT, "role": _STR},
    "checkpointed": {"gen": _INT, "rank": _INT, "step": _INT, "path": _STR},
    "commit": {"gen": _INT, "rank": _INT, "step": _INT, "dt": _NUM},
    "failed": {"gen": _INT, "rank": _INT, "committed": _INT, "error": _STR},
    "crash": {"gen": _INT, "rank": _INT, "step": _INT, "error": _STR, "traceback": _STR},
    "joined": {"gen": _INT, "rank": _INT, "timings": _DICT, "bytes": _INT},
    # a sharded job: where this rank's shard came from, and why (hotspare/sharded/fallback.py)
    "restored": {"gen": _INT, "rank": _INT, "sources": _LIST},
    "done": {"gen": _INT, "rank": _INT, "step": _INT, "digest": _STR},
    "paused": {"gen": _INT, "rank": _INT, "committed": _INT},
    "handed_off": {"gen": _INT, "rank": _INT, "bytes": _INT, "seconds": _NUM},
    # agent -> worker
    "generation": {"gen": _INT, "rank": _INT, "world": _INT, "prefix": _STR,
                   "target": _INT, "source": _INT, "receivers": _LIST},
    "abort": {"gen": _INT, "reason": _STR},
    "release": {"reason": _STR},
    "exit_now": {"code": _INT},
    "checkpoint_now": {},            # into the worker's own checkpoint directory (its contract)
    "fault": {"kind": _STR, "params": _DICT},
    "pause": {"gen": _INT, "reason": _STR},
    "probe": {"gen": _INT},          # a stall: which step's gradient exchange did you enter last?
    "watch": {"steps": (bool,)},     # send a "step" message as each step begins (armed faults)
    "go": {"wait": _INT},            # the agent saw the trigger with this "wait" number: go on
    "handoff": {"gen": _INT, "rank": _INT, "handoff": _STR},
    # node agent -> coordinator (hotspare.agent, hotspare.coordinator.nodes): what it saw happen
    "agent_hello": {"node": _STR, "pid": _INT, "devices": _LIST, "device_faults": _BOOL, "proof": _STR},
    "started": {"worker": _STR, "pid": _INT},
    "exited": {"worker": _STR, "code": _INT},
    "relay": {"worker": _STR, "t": _NUM, "msg": _DICT},      # a worker's message, as it arrived
    "injected": {"worker": _STR, "fault": _STR, "id": _INT, "t": _NUM},
    "stopped": {"worker": _STR, "stopped": _BOOL},           # the process is (no longer) SIGSTOPped
    "refused": {"command": _STR, "message": _STR},           # a command the agent could not carry out
    # the verdict of an "admit" or "diagnose" on one device (hotspare.agent.checks)
    "checked": {"device": _STR, "stage": _STR, "passed": _BOOL, "cancelled": _BOOL, "detail": _STR},
    # a remote agent's poll of its own host's devices (hotspare.agent.telemetry): each item
    # {device, time, source, metrics}; the node endpoint refuses devices not of that node
    "readings": {"readings": _LIST},
    # coordinator -> node agent: the coordinator decides, the agent carries out
    "spawn": {"worker": _STR, "role": _STR, "rank": _OPT_INT, "device": _OPT_STR},
    "kill": {"worker": _STR, "signal": _INT, "group": _BOOL},
    "deliver": {"worker": _STR, "msg": _DICT},               # for a worker's control channel
    "arm": {"id": _INT, "spec": _STR, "running": _BOOL},    # a fault to inject (hotspare.testing.faults)
    "disarm": {"id": _INT},                                  # it fired on another node
    "shutdown": {"grace": _NUM},                             # end the workers, then close the link
    # a remote node's lease (hotspare.agent.lease, hotspare.coordinator.lease): the coordinator's
    # first word to an agent that connected over the network, and the renewals that follow
    # optional "telemetry_period": seconds between the agent's polls of its devices (0 or absent: none)
    "welcome": {"lease": _NUM, "script": _STR, "args": _LIST, "env": _DICT, "proof": _STR},
    # a node agent and the coordinator service (hotspare coordinator, hotspare.service): the
    # service's first word (the agent is in its pool, no job yet; ``job``: the job it resumed),
    # a job placed on the node, and the agent's word that it resumed a job after the service
    # restarted (its replayed messages went first) or that it ended its part of one
    "registered": {"lease": _NUM, "proof": _STR, "job": _STR},
    # optional "telemetry_period", as in the welcome
    "assign": {"job": _STR, "script": _STR, "args": _LIST, "env": _DICT, "devices": _LIST},
    "resumed": {"job": _STR, "alive": _LIST},
    "released": {"job": _STR},
    "renew": {"seq": _INT},                                  # agent -> coordinator
    "renewed": {"seq": _INT},                                # coordinator -> agent
    "admit": {"devices": _LIST, "size": _STR},               # admission checks of these devices
    # one pass of quarantine diagnostics; optional "reset": true before the first (the device is reset)
    "diagnose": {"device": _STR, "size": _STR},
    # operator (hotspare inject) <-> launcher
    "inject": {"spec": _STR, "operator": _STR, "proof": _STR},
    "control_reply": {"ok": (bool,), "message": _STR},
    # a client (hotspare submit, status, cancel) -> the coordinator service; answered with a
    # control_reply whose extra fields carry the result
    "request": {"operator": _STR, "command": _STR, "args": _DICT, "proof": _STR},
}

# What a worker may say to its agent (and the agent relays): nothing else is relayed.
FROM_WORKER = frozenset({"ready", "step", "reducing", "joining", "transfer", "checkpointed", "commit",
                         "failed", "crash", "joined", "restored", "done", "paused", "handed_off"})

_BIG = 2 ** 62
# field -> (lowest, highest) accepted, wherever it appears as a number
RANGES: dict[str, tuple[float, float]] = {
    "gen": (0, 2 ** 31), "rank": (0, 2 ** 20), "world": (1, 2 ** 20), "step": (-1, _BIG),
    "committed": (-1, _BIG), "total": (0, _BIG), "bytes": (0, _BIG), "pid": (1, 2 ** 31),
    "wait": (0, _BIG), "id": (-1, _BIG), "seq": (0, _BIG), "lease": (0.1, 3600),
    "dt": (0, 1e7), "seconds": (0, 1e7), "grace": (0, 3600), "t": (0, 1e11),
    "telemetry_period": (0, 3600),
    "compute": (0, 1e7), "comm": (0, 1e7), "check": (0, 1e7), "check_cpu": (0, 1e7), "fp": (0, 1e7),
}
MAX_ITEMS = 1024                  # entries of a nested list or dict
MAX_NAME = 256                    # a metric's, timing's or device's name
MAX_METRICS = 64                  # metrics of one reading
MAX_XIDS = 64                     # Xid codes of one reading


Message = dict[str, Any]


class VersionError(ProtocolError):
    """A message of another protocol version (``theirs``: the version it says, as sent; ``ours``:
    this process's)."""

    def __init__(self, theirs: Any):
        self.theirs, self.ours = theirs, VERSION
        super().__init__(f"protocol version {theirs!r:.40} is not supported (this is v{VERSION}); "
                         "run the same hotspare version on every host, worker and agent")


def draft(type_: str, **fields: Any) -> Message:
    """A message not checked yet: for ``Channel.send_later``, which checks it when it goes."""
    return {"v": VERSION, "type": type_, **fields}


def make(type_: str, **fields: Any) -> Message:
    return validate(draft(type_, **fields))


def encode(msg: Message) -> bytes:
    return (json.dumps(msg, separators=(",", ":"), allow_nan=False) + "\n").encode()


def _fail(kind: str, what: str) -> None:
    raise ProtocolError(f"message {kind!r}: {what}")


def _number(value: Any) -> bool:
    """A finite number (bools are not numbers here)."""
    return (type(value) is int or (type(value) is float and math.isfinite(value)))


def _mapping(kind: str, field: str, value: Any, ok: Callable[[Any], bool], expect: str) -> None:
    if not isinstance(value, dict) or len(value) > MAX_ITEMS:
        _fail(kind, f"field {field!r} must be an object of at most {MAX_ITEMS} entries")
    for k, v in value.items():
        if len(k) > MAX_NAME or not ok(v):
            _fail(kind, f"field {field!r}: entry {k[:40]!r} must be {expect}")


def _sequence(kind: str, field: str, value: Any, ok: Callable[[Any], bool], expect: str) -> None:
    if not isinstance(value, list) or len(value) > MAX_ITEMS or not all(map(ok, value)):
        _fail(kind, f"field {field!r} must be a list of at most {MAX_ITEMS} {expect}")


def _rank(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and RANGES["rank"][0] <= v <= RANGES["rank"][1]


def _short(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= MAX_NAME


def _restore_source(v: Any) -> bool:
    """One entry of a "restored" message: short names to numbers, nulls or strings (a reason)."""
    return isinstance(v, dict) and len(v) <= 16 and all(
        isinstance(k, str) and len(k) <= 40 and (v[k] is None or _number(v[k]) or isinstance(v[k], str)
                                                and len(v[k]) <= 1000) for k in v)


def _metric(v: Any) -> bool:
    return _number(v) or (isinstance(v, str) and len(v) <= MAX_NAME)


def _health(kind: str, value: Any) -> None:
    if not isinstance(value, dict):
        _fail(kind, "field 'health' must be an object")
    if not isinstance(value.get("kind"), str) or not isinstance(value.get("detail", ""), str):
        _fail(kind, "health needs 'kind' (and 'detail') as strings")
    _sequence(kind, "health.suspects", value.get("suspects"), _rank, "ranks")
    step = value.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not -1 <= step <= _BIG:
        _fail(kind, "health needs 'step' as a step number")


def _xid(v: Any) -> bool:
    return type(v) is int and 0 <= v <= 2 ** 31


def _reading_value(key: str, v: Any) -> bool:
    if key == "xids":
        return isinstance(v, list) and len(v) <= MAX_XIDS and all(map(_xid, v))
    return isinstance(v, bool) or _metric(v)


def _reading(kind: str, item: Any) -> None:
    """One device reading of a ``readings`` message: bounded, finite, plain values only."""
    if not isinstance(item, dict) or not _short(item.get("device")) or item.get("source") not in ("nvml", "simulated"):
        _fail(kind, "each reading needs 'device' (a short string) and 'source' ('nvml' or 'simulated')")
    t = item.get("time")
    if not _number(t) or not RANGES["t"][0] <= t <= RANGES["t"][1]:
        _fail(kind, f"reading of {item['device'][:40]!r}: 'time' must be a finite time stamp")
    metrics = item.get("metrics")
    if not isinstance(metrics, dict) or len(metrics) > MAX_METRICS:
        _fail(kind, f"reading of {item['device'][:40]!r}: 'metrics' must be an object of at most {MAX_METRICS} entries")
    for k, v in metrics.items():
        if len(k) > MAX_NAME or not _reading_value(k, v):
            _fail(kind, f"reading of {item['device'][:40]!r}: metric {k[:40]!r} must be a finite number, a bool, "
                        f"a short string (xids: a list of at most {MAX_XIDS} codes)")


def _readings(kind: str, value: Any) -> None:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_ITEMS:
        _fail(kind, f"field 'readings' must be a list of 1 to {MAX_ITEMS} readings")
    for item in value:
        _reading(kind, item)


# type -> {nested field: its check}; the field is checked when present (required ones by SCHEMA)
NESTED: dict[str, dict[str, Callable[[str, Any], None]]] = {
    "commit": {"metrics": lambda k, v: _mapping(k, "metrics", v, _metric, "a finite number or a short string")},
    "joined": {"timings": lambda k, v: _mapping(k, "timings", v, _number, "a finite number")},
    "failed": {"health": _health},
    "restored": {"sources": lambda k, v: _sequence(k, "sources", v, _restore_source, "restore sources")},
    "generation": {"receivers": lambda k, v: _sequence(k, "receivers", v, _rank, "ranks"),
                   "placement": lambda k, v: _sequence(k, "placement", v, _rank, "ranks"),
                   "before": lambda k, v: _sequence(k, "before", v, _rank, "ranks")},
    "agent_hello": {"devices": lambda k, v: _sequence(k, "devices", v, _short, "device names")},
    "welcome": {"args": lambda k, v: _sequence(k, "args", v, lambda a: isinstance(a, str), "strings"),
                "env": lambda k, v: _mapping(k, "env", v, lambda e: isinstance(e, str) and len(e) <= 65536,
                                             "a string")},
    "admit": {"devices": lambda k, v: _sequence(k, "devices", v, _short, "device names")},
    "assign": {"args": lambda k, v: _sequence(k, "args", v, lambda a: isinstance(a, str), "strings"),
               "env": lambda k, v: _mapping(k, "env", v, lambda e: isinstance(e, str) and len(e) <= 65536,
                                            "a string"),
               "devices": lambda k, v: _sequence(k, "devices", v, _short, "device names")},
    "resumed": {"alive": lambda k, v: _sequence(k, "alive", v, _short, "worker ids")},
    "readings": {"readings": _readings},
}


def _check_values(kind: str, msg: Message) -> None:
    for name, value in msg.items():
        if type(value) is float and not math.isfinite(value):          # 1e999 parses as inf
            _fail(kind, f"field {name!r} is not a finite number")
        bounds = RANGES.get(name)
        if bounds is not None and type(value) in (int, float) and not bounds[0] <= value <= bounds[1]:
            _fail(kind, f"field {name!r} = {value!r} is outside {bounds[0]:g}..{bounds[1]:g}")
    for name, check in NESTED.get(kind, {}).items():
        if name in msg:
            check(kind, msg[name])


def validate(msg: Any, any_version: bool = False) -> Message:
    """``msg`` if it is a message of this protocol version (``any_version``: or one of
    ``EVERY_VERSION`` of any version) that matches the schema; else ProtocolError."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"a control message must be a JSON object, got {type(msg).__name__}")
    kind = msg.get("type")
    if msg.get("v") != VERSION and not (any_version and kind in EVERY_VERSION):
        raise VersionError(msg.get("v"))
    fields = SCHEMA.get(kind)  # type: ignore[arg-type]
    if fields is None:
        raise ProtocolError(f"unknown message type {kind!r}; known: {', '.join(sorted(SCHEMA))}")
    for name, types in fields.items():
        if name not in msg:
            raise ProtocolError(f"message {kind!r} lacks field {name!r}")
        value = msg[name]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise ProtocolError(f"message {kind!r}: field {name!r} must be "
                                f"{'/'.join(t.__name__ for t in types)}, got {type(value).__name__}")
    _check_values(kind, msg)
    return msg


def decode(line: bytes, max_line: int = MAX_LINE, any_version: bool = False) -> Message:
    if len(line) > max_line:
        raise ProtocolError(f"control message of {len(line)} bytes exceeds the {max_line}-byte limit")
    try:
        msg = json.loads(line, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:    # bad JSON or UTF-8, NaN, Infinity, a 5000-digit int
        raise ProtocolError(f"control message is not valid JSON: {str(e)[:200]}") from None
    return validate(msg, any_version)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number a control message may carry")

