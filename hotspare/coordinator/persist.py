"""A job's coordinator state as JSON: what a restarted coordinator needs to carry on.

``capture(coordinator)`` returns the job's state as plain JSON: the policy's ``ClusterView``
(phase, generation, members, spares, reports), the coordinator's picture of the workers and
nodes (``Nodes``, without their links), the ledger (commits, failure and migration records) and
the executor's counters. ``restore(coordinator, state)`` puts it back into a freshly built
coordinator of the same job. The live parts are not in it: links re-form when the node agents
re-register (``hotspare.service``), and the progress clock starts afresh.

Nothing read back can run code: the codec below rebuilds only the dataclasses and enums named
in ``_TYPES`` (each from its own fields), and plain JSON values; anything else is refused.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

from hotspare.coordinator.ledger import FailureRecord, Ledger, MigrationRecord
from hotspare.coordinator.nodes import Node, Worker
from hotspare.errors import ProtocolError
from hotspare.policy import actions, signals
from hotspare.policy.phase import JobPhase
from hotspare.policy.view import ClusterView
from hotspare.protocol.messages import validate

FORMAT = 1
_TYPES: dict[str, type] = {cls.__name__: cls for cls in (
    ClusterView, Worker, Ledger, FailureRecord, MigrationRecord, JobPhase, signals.FailureCause,
    signals.Crashed, signals.Done, signals.Checkpointed, actions.Pause, actions.FormGeneration, actions.Regrow)}


def encode(value: Any) -> Any:
    """``value`` as JSON-safe data, tagged where JSON has no such type."""
    if isinstance(value, enum.Enum):
        _known(type(value))
        return {"$enum": type(value).__name__, "value": value.value}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        _known(type(value))
        return {"$type": type(value).__name__,
                **{f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, (set, frozenset)):
        return {"$set": sorted((encode(v) for v in value), key=repr)}
    if isinstance(value, tuple):
        return {"$tuple": [encode(v) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode(v) for k, v in value.items()}
        return {"$map": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot persist a {type(value).__name__}")


def decode(data: Any) -> Any:
    """The inverse of ``encode``; ProtocolError for anything it did not write."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if "$enum" in data:
        return _known_name(data["$enum"])(data["value"])
    if "$type" in data:
        cls = _known_name(data["$type"])
        fields = {f.name for f in dataclasses.fields(cls)}
        given = {k: decode(v) for k, v in data.items() if k != "$type"}
        if set(given) - fields:
            raise ProtocolError(f"persisted {cls.__name__} has unknown fields {sorted(set(given) - fields)}")
        return cls(**given)
    if "$set" in data:
        return {_hashable(decode(v)) for v in data["$set"]}
    if "$tuple" in data:
        return tuple(decode(v) for v in data["$tuple"])
    if "$map" in data:
        return {_hashable(decode(k)): decode(v) for k, v in data["$map"]}
    return {k: decode(v) for k, v in data.items()}


def _hashable(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _known(cls: type) -> None:
    if _TYPES.get(cls.__name__) is not cls:
        raise TypeError(f"{cls.__name__} is not a type the coordinator persists")


def _known_name(name: Any) -> type:
    cls = _TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"persisted state names an unknown type {str(name)[:64]!r}")
    return cls


# ---------------------------------------------------------------------- a coordinator's state
def capture(coord) -> dict[str, Any]:
    """The job's state (``coordinator.Coordinator``), as JSON-safe data."""
    nodes = coord.nodes
    return {
        "format": FORMAT,
        "view": encode(coord.view),
        "ledger": encode(coord.ledger),
        # the open failure records are records of ``failures`` too (the same objects): by index
        "open": [next(i for i, f in enumerate(coord.ledger.failures) if f is o) for o in coord.ledger.open],
        "workers": encode(list(nodes.workers.values())),
        "nodes": {n.name: {"devices": n.devices, "lost": n.lost, "lost_at": n.lost_at, "pid": n.pid,
                           "device_faults": n.device_faults, "workers": sorted(n.workers)}
                  for n in nodes.nodes.values()},
        "next_worker": nodes.next_id,
        "orders": nodes.orders,
        "joined": sorted(coord.progress.joined),
        "unplaced": coord.executor.unplaced,
        "failed_checkpoints": sorted(coord.vetter.failed),
    }


def restore(coord, state: dict[str, Any]) -> list[str]:
    """Put ``state`` back into ``coord``, a coordinator built afresh for the same job; the nodes
    that were live, now waiting for their agents to re-register (``Node.channel`` None)."""
    if state.get("format") != FORMAT:
        raise ProtocolError(f"persisted coordinator state of format {state.get('format')!r}, not {FORMAT}")
    view, ledger = decode(state["view"]), decode(state["ledger"])
    if not isinstance(view, ClusterView) or not isinstance(ledger, Ledger):
        raise ProtocolError("persisted coordinator state lacks its view or ledger")
    # The coordinator's parts share these objects: replace their contents, not the objects.
    for f in dataclasses.fields(ClusterView):
        setattr(coord.view, f.name, getattr(view, f.name))
    ledger.open = [ledger.failures[i] for i in state["open"]]
    for f in dataclasses.fields(Ledger):
        setattr(coord.ledger, f.name, getattr(ledger, f.name))
    nodes = coord.nodes
    nodes.workers = {w.worker: w for w in decode(state["workers"])}
    waiting = []
    for name, n in state["nodes"].items():
        node = Node(name, None, list(n["devices"]), bool(n["device_faults"]), int(n["pid"]), lost=bool(n["lost"]),
                    lost_at=n["lost_at"], workers=set(n["workers"]))
        nodes.nodes[name] = node
        if not node.lost:
            waiting.append(name)
    nodes.next_id = int(state["next_worker"])
    nodes.orders = {w: validate(dict(m)) for w, m in state["orders"].items()}
    coord.progress.joined = set(state["joined"])
    coord.executor.unplaced = int(state["unplaced"])
    coord.vetter.failed = set(state["failed_checkpoints"])
    return waiting
