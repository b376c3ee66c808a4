"""A device's record in the registry: its dataclass, its JSON form and the pure views of many
records (which nodes have devices out of service). No I/O here: ``registry`` reads and writes
the file."""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

from hotspare.errors import ConfigError
from hotspare.health.lifecycle import OUT_OF_SERVICE, State, Transition
from hotspare.health.types import Reading, node_of

_DEVICE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z]+[0-9]+$")

def check_device_name(device: str) -> str:
    if not isinstance(device, str) or not _DEVICE_RE.match(device):
        raise ConfigError(f"device name {device!r} must look like NODE/KINDINDEX, e.g. 'host1/gpu0' "
                          f"(NODE is the host name Slurm knows, KIND letters, INDEX digits)")
    return device


@dataclasses.dataclass(frozen=True)
class LastReading:
    source: str
    time: float
    metrics: Mapping[str, Any]
    rank: int | None = None


@dataclasses.dataclass(frozen=True)
class DeviceRecord:
    device: str
    node: str
    state: State
    reason: str
    since: float                      # when it entered ``state``
    actor: str                        # who moved it there
    history: tuple[Transition, ...]   # oldest first
    readings: Mapping[str, LastReading]   # the last reading per source
    diagnostics_passes: int           # in a row, since it entered quarantine
    remediations: tuple[float, ...]   # times a rule took it out of service (or record_remediation)
    rank: int | None
    job: str | None
    revision: int                     # registry revision of the last change to this record

    @property
    def last_reading(self) -> LastReading | None:
        return max(self.readings.values(), key=lambda r: r.time, default=None)

    def to_json(self) -> dict[str, Any]:
        return record_to_json(self)


def new_record(device: str, state: State, reason: str, actor: str, now: float) -> dict[str, Any]:
    return {"node": node_of(device), "state": state.value, "reason": reason, "since": now,
            "actor": actor, "history": [], "readings": {}, "diagnostics_passes": 0,
            "remediations": [], "rank": None, "job": None, "revision": 0}


def _metrics_from_json(m: Mapping[str, Any]) -> dict[str, Any]:
    # JSON has no tuples; metric values that are sequences (e.g. xids) are tuples in types.Reading.
    return {k: tuple(v) if isinstance(v, list) else v for k, v in m.items()}


def record_from_json(device: str, d: Mapping[str, Any]) -> DeviceRecord:
    return DeviceRecord(
        device=device, node=str(d["node"]), state=State(d["state"]), reason=str(d["reason"]),
        since=float(d["since"]), actor=str(d["actor"]),
        history=tuple(Transition.from_json(t) for t in d["history"]),
        readings={src: LastReading(src, float(r["time"]), _metrics_from_json(r["metrics"]), r.get("rank"))
                  for src, r in d["readings"].items()},
        diagnostics_passes=int(d["diagnostics_passes"]),
        remediations=tuple(float(t) for t in d["remediations"]),
        rank=d["rank"], job=d["job"], revision=int(d["revision"]))


def record_to_json(r: DeviceRecord) -> dict[str, Any]:
    return {"device": r.device, "node": r.node, "state": r.state.value, "reason": r.reason,
            "since": r.since, "actor": r.actor, "history": [t.to_json() for t in r.history],
            "readings": {s: {"time": x.time, "metrics": dict(x.metrics), "rank": x.rank}
                         for s, x in r.readings.items()},
            "diagnostics_passes": r.diagnostics_passes, "remediations": list(r.remediations),
            "rank": r.rank, "job": r.job, "revision": r.revision}



def storable(r: Reading) -> dict[str, Any]:
    """A reading's metrics as strict JSON: numpy scalars unwrapped, NaN/Inf as the strings "nan"/"inf"."""
    out = {}
    for k, v in r.metrics.items():
        v = v.item() if hasattr(v, "item") else v
        if isinstance(v, (list, tuple)):
            v = [x.item() if hasattr(x, "item") else x for x in v]
        if isinstance(v, float) and not math.isfinite(v):
            v = str(v)
        if not isinstance(v, (bool, int, float, str, list)) or \
                (isinstance(v, list) and not all(isinstance(x, (bool, int, float, str)) for x in v)):
            raise ConfigError(f"reading of {r.device} from {r.source}: metric {k!r} has a value of "
                              f"type {type(v).__name__}; use int, float, bool, str or a tuple of them")
        out[k] = v
    return out


def out_by_node(devices: Mapping[str, Any]) -> dict[str, tuple[tuple[str, str, str], ...]]:
    """Per node, ``(device, state, reason)`` of its out-of-service devices, sorted; nodes with none
    are left out."""
    out: dict[str, list[tuple[str, str, str]]] = {}
    for name, d in devices.items():
        if State(d["state"]) in OUT_OF_SERVICE:
            out.setdefault(d["node"], []).append((name, d["state"], d["reason"]))
    return {node: tuple(sorted(entries)) for node, entries in out.items()}
