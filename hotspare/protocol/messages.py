"""Control messages: one JSON object per line, versioned, validated on arrival.

Only small metadata travels here (tensors go peer to peer over torch.distributed), and nothing
received is ever unpickled: a message is plain JSON checked against the schema below. A message
of another protocol version, an unknown type, or a missing/mistyped field is refused with a
``ProtocolError`` that names the problem; the sender's connection is dropped, the job goes on.
"""
from __future__ import annotations

import json
from typing import Any

from hotspare.errors import ProtocolError

VERSION = 1
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
    # worker -> agent
    "hello": {"worker": _STR, "pid": _INT, "role": _STR},
    "ready": {"worker": _STR, "committed": _INT},
    # "step", "joining" and "transfer" are fault triggers: while faults are armed ("watch") they
    # carry a "wait" sequence number, and the worker goes on only once the agent answers "go"
    # with it, so an injected fault lands exactly there (hotspare.agent.inject)
    "step": {"gen": _INT, "rank": _INT, "step": _INT},        # only while the agent watches steps
    "reducing": {"gen": _INT, "rank": _INT, "step": _INT},    # the answer to a probe
    "joining": {"gen": _INT, "rank": _INT},
    "transfer": {"gen": _INT, "rank": _INT, "role": _STR},
    "checkpointed": {"gen": _INT, "rank": _INT, "step": _INT, "path": _STR},
    "commit": {"gen": _INT, "rank": _INT, "step": _INT, "dt": _NUM},
    "failed": {"gen": _INT, "rank": _INT, "committed": _INT, "error": _STR},
    "crash": {"gen": _INT, "rank": _INT, "step": _INT, "error": _STR, "traceback": _STR},
    "joined": {"gen": _INT, "rank": _INT, "timings": _DICT, "bytes": _INT},
    "done": {"gen": _INT, "rank": _INT, "step": _INT, "digest": _STR},
    "paused": {"gen": _INT, "rank": _INT, "committed": _INT},
    "handed_off": {"gen": _INT, "rank": _INT, "bytes": _INT, "seconds": _NUM},
    # agent -> worker
    "generation": {"gen": _INT, "rank": _INT, "world": _INT, "prefix": _STR,
                   "target": _INT, "source": _INT, "receivers": _LIST},
    "abort": {"gen": _INT, "reason": _STR},
    "release": {"reason": _STR},
    "exit_now": {"code": _INT},
    "checkpoint_now": {"directory": _STR},
    "fault": {"kind": _STR, "params": _DICT},
    "pause": {"gen": _INT, "reason": _STR},
    "probe": {"gen": _INT},          # a stall: which step's gradient exchange did you enter last?
    "watch": {"steps": (bool,)},     # send a "step" message as each step begins (armed faults)
    "go": {"wait": _INT},            # the agent saw the trigger with this "wait" number: go on
    "handoff": {"gen": _INT, "rank": _INT, "handoff": _STR},
    # node agent -> coordinator (hotspare.agent, hotspare.coordinator.nodes): what it saw happen
    "agent_hello": {"node": _STR, "pid": _INT, "devices": _LIST, "device_faults": _BOOL},
    "started": {"worker": _STR, "pid": _INT},
    "exited": {"worker": _STR, "code": _INT},
    "relay": {"worker": _STR, "t": _NUM, "msg": _DICT},      # a worker's message, as it arrived
    "injected": {"worker": _STR, "fault": _STR, "id": _INT, "t": _NUM},
    "stopped": {"worker": _STR, "stopped": _BOOL},           # the process is (no longer) SIGSTOPped
    "refused": {"command": _STR, "message": _STR},           # a command the agent could not carry out
    # coordinator -> node agent: the coordinator decides, the agent carries out
    "spawn": {"worker": _STR, "role": _STR, "rank": _OPT_INT, "device": _OPT_STR},
    "kill": {"worker": _STR, "signal": _INT, "group": _BOOL},
    "deliver": {"worker": _STR, "msg": _DICT},               # for a worker's control channel
    "arm": {"id": _INT, "spec": _STR, "running": _BOOL},    # a fault to inject (hotspare.agent.inject)
    "disarm": {"id": _INT},                                  # it fired on another node
    "shutdown": {"grace": _NUM},                             # end the workers, then close the link
    # operator (hotspare inject) <-> launcher
    "inject": {"spec": _STR},
    "control_reply": {"ok": (bool,), "message": _STR},
}


Message = dict[str, Any]


def make(type_: str, **fields: Any) -> Message:
    msg = {"v": VERSION, "type": type_, **fields}
    validate(msg)
    return msg


def encode(msg: Message) -> bytes:
    return (json.dumps(msg, separators=(",", ":"), allow_nan=False) + "\n").encode()


def validate(msg: Any) -> Message:
    if not isinstance(msg, dict):
        raise ProtocolError(f"a control message must be a JSON object, got {type(msg).__name__}")
    if msg.get("v") != VERSION:
        raise ProtocolError(f"protocol version {msg.get('v')!r} is not supported (this is v{VERSION}); "
                            "run the same hotspare version on every worker and agent")
    kind = msg.get("type")
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
    return msg


def decode(line: bytes) -> Message:
    if len(line) > MAX_LINE:
        raise ProtocolError(f"control message of {len(line)} bytes exceeds the {MAX_LINE}-byte limit")
    try:
        msg = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"control message is not valid JSON: {e}") from None
    return validate(msg)
