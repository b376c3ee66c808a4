"""The persisted device registry: one JSON file that the coordinator and ``hotspare`` CLI calls share.

Where: ``Registry(path)``; ``path=None`` means ``$HOTSPARE_HEALTH_DB`` or ``~/.hotspare/health.json``.

Per device it holds the lifecycle state (``lifecycle.State``) with the reason, the actor and the
time it entered it, the transition history (the newest ``HISTORY_KEEP``), the last reading of each
telemetry source, the diagnostics passes in a row since quarantine, remediation timestamps (for the
repeat-offender rule), and the rank/job on the device.

Where it is kept (``hotspare.health.regstore``): a JSON file, or, for a path ending in ``.db``, a
table of that SQLite database (the coordinator service keeps its devices' health in its own
database this way). Safety: every write is an exclusive transaction that re-reads the registry,
applies the change and writes it back whole (a file: to a temporary file, fsynced and
``os.replace``d; SQLite: ``BEGIN IMMEDIATE`` ... ``COMMIT``), so concurrent writers (the
coordinator, CLI calls) never lose each other's updates and a reader (which takes no lock) sees
either the old registry or the new one, never a half-written one. A registry that is not valid
registry JSON, or that a newer hotspare wrote, raises ``RegistryError``; it is never reset silently.

Change detection: the file carries a ``revision`` that every write increments, and each device
record the revision of its last change, so a poller asks ``changed_since(last_revision)``. The
parsed file is cached by its text, so polling an unchanged registry costs one read and no parse.

Slurm: the registry is the *desired* state of each node (drained while any of its devices is out
of service, ``out_of_service()``). It never calls Slurm: the reconciler (``hotspare.health.reconcile``)
compares that with Slurm's and calls ``scontrol`` outside the lock, after writes and periodically,
and records here what happened last per node (``slurm_status()``: the reason it applied, the last
error), so a failure is seen and retried rather than lost.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from hotspare.errors import ConfigError, HotspareError, InvalidTransition
from hotspare.health import lifecycle
from hotspare.health.lifecycle import IN_SERVICE, OUT_OF_SERVICE, State
from hotspare.health.regstore import FileStore, StoreError, store_for
from hotspare.health.records import (DeviceRecord, LastReading, check_device_name, new_record, out_by_node,
                                     record_from_json, storable)
from hotspare.health.types import Reading

__all__ = ["Registry", "RegistryError", "UnknownDevice", "DeviceRecord", "LastReading", "SlurmStatus",
           "check_device_name", "default_path", "ENV_PATH"]

ENV_PATH = "HOTSPARE_HEALTH_DB"
DEFAULT_PATH = "~/.hotspare/health.json"
FORMAT = "hotspare-health-registry"
SCHEMA = 1
HISTORY_KEEP = 200          # transitions kept per device
REMEDIATIONS_KEEP = 100     # remediation timestamps kept per device

# How far along the way out of service a state is, for the idempotent convenience methods.
_DEPTH = {State.HEALTHY: 0, State.SUSPECT: 0, State.CORDONED: 1, State.DRAINING: 2,
          State.QUARANTINED: 3, State.RETIRED: 4}


class RegistryError(HotspareError):
    """The registry file cannot be used as it is (corrupt, unknown schema, unreadable)."""


class UnknownDevice(ConfigError):
    """A device name the registry does not hold."""


def default_path() -> Path:
    return Path(os.environ.get(ENV_PATH) or DEFAULT_PATH).expanduser()


def _empty() -> dict[str, Any]:
    return {"format": FORMAT, "schema": SCHEMA, "revision": 0, "devices": {}}


@dataclasses.dataclass(frozen=True)
class SlurmStatus:
    """What the reconciler last did to one node (``Registry.slurm_status``)."""
    node: str
    want: str | None        # the drain reason it applied, None: in service
    error: str | None       # why the last reconcile of the node failed; None: it succeeded
    time: float


class Registry:
    """The device registry in one JSON file. Safe to use from several processes at once."""

    def __init__(self, path: str | os.PathLike | None = None, *,
                 passes_required: int = lifecycle.DEFAULT_PASSES_REQUIRED,
                 clock: Callable[[], float] = time.time):
        if passes_required < 1:
            raise ConfigError(f"passes_required must be at least 1, got {passes_required}")
        self.path = Path(path).expanduser() if path is not None else default_path()
        self.store = store_for(self.path)          # a JSON file, or a table of a SQLite database
        self.passes_required = passes_required
        self.clock = clock
        self._cache: tuple[str, dict[str, Any]] | None = None
        self._stamp: tuple[int, ...] | None = None     # the file version the cache was read from

    def __repr__(self) -> str:
        return f"Registry({str(self.path)!r})"

    # --- reading -------------------------------------------------------------------------------
    def _parse(self, text: str) -> dict[str, Any]:
        fix = ("hotspare never resets it on its own: restore it from a backup, or move it away "
               "to start an empty registry")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise RegistryError(f"health registry {self.path} is not valid JSON ({e}); {fix}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise RegistryError(f"{self.path} is not a hotspare health registry (no "
                                f"\"format\": \"{FORMAT}\"); {fix}")
        schema = data.get("schema")
        if not isinstance(schema, int) or schema < 1:
            raise RegistryError(f"health registry {self.path} has an invalid schema {schema!r}; {fix}")
        if schema > SCHEMA:
            raise RegistryError(f"health registry {self.path} has schema {schema}, written by a newer "
                                f"hotspare; this one reads schema {SCHEMA}: upgrade hotspare")
        try:
            int(data["revision"])
            for device, d in data["devices"].items():
                record_from_json(device, d)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RegistryError(f"health registry {self.path} has a malformed entry "
                                f"({type(e).__name__}: {e}); {fix}") from None
        return data

    def _read(self, text: str | None = None) -> dict[str, Any]:
        """The registry's content (``text``: as just read), parsed again only when its text
        changed. Do not mutate it."""
        if text is None:
            # A job's launcher looks for operator commands every second: a file whose version
            # did not change is not read again (a stat, not a read and a compare).
            stamp = self.store.stamp() if isinstance(self.store, FileStore) else None
            if stamp is not None and stamp == self._stamp and self._cache is not None:
                return self._cache[1]
            try:
                text = self.store.read()
            except StoreError as e:
                raise RegistryError(f"health registry {self.path}: {e}") from None
            self._stamp = stamp            # taken before the read: a write in between is read next time
        if text is None:
            return _empty()
        if self._cache is not None and self._cache[0] == text:
            return self._cache[1]
        data = self._parse(text)
        self._cache = (text, data)
        return data

    def revision(self) -> int:
        return int(self._read()["revision"])

    def devices(self) -> list[DeviceRecord]:
        """Every device, sorted by name."""
        devices = self._read()["devices"]
        return [record_from_json(name, devices[name]) for name in sorted(devices)]

    def find(self, device: str) -> DeviceRecord | None:
        d = self._read()["devices"].get(check_device_name(device))
        return None if d is None else record_from_json(device, d)

    def get(self, device: str) -> DeviceRecord:
        record = self.find(device)
        if record is None:
            raise self._unknown(device, self._read())
        return record

    def changed_since(self, revision: int) -> tuple[int, list[DeviceRecord]]:
        """``(current revision, records changed after `revision`)``; poll with the returned revision."""
        data = self._read()
        changed = [record_from_json(n, d) for n, d in sorted(data["devices"].items())
                   if int(d["revision"]) > revision]
        return int(data["revision"]), changed

    def _unknown(self, device: str, data: Mapping[str, Any]) -> UnknownDevice:
        known = sorted(data["devices"])
        close = difflib.get_close_matches(device, known, n=3)
        hint = (f"did you mean {', '.join(close)}?" if close else
                f"known devices: {', '.join(known[:10])}{' ...' if len(known) > 10 else ''}" if known else
                "the registry is empty")
        return UnknownDevice(f"no device {device!r} in the health registry {self.path}; {hint} "
                             f"(devices appear once the coordinator, a telemetry source or a check "
                             f"registers them)")

    # --- writing -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """Exclusive lock; yields a fresh copy of the registry to mutate; writes it back atomically.

        Nothing is written when the body leaves the data unchanged or raises.
        """
        try:
            with self.store.exclusive() as tx:
                text = tx.read()
                before = _empty() if text is None else self._read(text)
                data = copy.deepcopy(before)
                yield data
                if data != before:
                    text = json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n"
                    tx.write(text)
                    self._cache = (text, data)
        except StoreError as e:
            raise RegistryError(f"health registry {self.path}: {e}") from None

    @contextlib.contextmanager
    def _update(self) -> Iterator[dict[str, Any]]:
        """``_locked`` plus the bookkeeping: when the body changed any device, the file revision
        goes up by one and every changed record is stamped with it. A pure file update: what it
        means for Slurm is the reconciler's business, after the lock is released."""
        with self._locked() as data:
            old = copy.deepcopy(data["devices"])
            yield data
            devices = data["devices"]
            changed = [n for n, d in devices.items() if old.get(n) != d]
            if changed or set(old) - set(devices):
                data["revision"] = int(data["revision"]) + 1
                for n in changed:
                    devices[n]["revision"] = data["revision"]

    def _rec(self, data: dict[str, Any], device: str) -> dict[str, Any]:
        rec = data["devices"].get(check_device_name(device))
        if rec is None:
            raise self._unknown(device, data)
        return rec

    def _move(self, data: dict[str, Any], device: str, to: State | str, reason: str, actor: str) -> None:
        rec = self._rec(data, device)
        src = State(rec["state"])
        t = lifecycle.transition(src, to, actor=actor, reason=reason, time=self.clock(), device=device,
                                 passes=int(rec["diagnostics_passes"]),
                                 passes_required=self.passes_required)
        rec.update(state=t.dst.value, reason=t.reason, since=t.time, actor=t.actor)
        rec["history"] = (rec["history"] + [t.to_json()])[-HISTORY_KEEP:]
        if t.dst is State.QUARANTINED or t.dst in IN_SERVICE:
            rec["diagnostics_passes"] = 0
        if src in IN_SERVICE and t.dst in OUT_OF_SERVICE and lifecycle.actor_kind(actor) == lifecycle.RULE:
            rec["remediations"] = (rec["remediations"] + [t.time])[-REMEDIATIONS_KEEP:]

    def ensure(self, device: str, *, state: State | str = State.HEALTHY,
               reason: str = "registered", actor: str = "operator") -> DeviceRecord:
        """The device's record, created in ``state`` (default healthy) if it is new.

        An existing record is returned unchanged, whatever ``state`` says. A check that must admit
        new devices first can create them as ``quarantined``.
        """
        check_device_name(device)
        state = lifecycle.parse_state(state)
        lifecycle.actor_kind(actor)
        with self._update() as data:
            if device not in data["devices"]:
                data["devices"][device] = new_record(device, state, reason, actor, self.clock())
        return record_from_json(device, data["devices"][device])

    def forget(self, device: str) -> None:
        """Drop a device's record (e.g. after its hardware was replaced: the new part starts fresh)."""
        with self._update() as data:
            self._rec(data, device)
            del data["devices"][device]

    def transition(self, device: str, to: State | str, *, reason: str, actor: str) -> DeviceRecord:
        """One move of the lifecycle table; ``InvalidTransition`` if the table does not allow it."""
        with self._update() as data:
            self._move(data, device, lifecycle.parse_state(to), reason, actor)
        return record_from_json(device, data["devices"][device])

    # --- convenience: idempotent walks along the table ------------------------------------------
    def cordon(self, device: str, reason: str, actor: str = "operator") -> DeviceRecord:
        """No new work. A device already cordoned, draining, quarantined or retired is left as is."""
        return self._out(device, State.CORDONED, reason, actor, {})

    def drain(self, device: str, reason: str, actor: str = "operator") -> DeviceRecord:
        """Cordon (if needed) and mark its work to be moved off. No-op from draining on."""
        H, S, C, D = State.HEALTHY, State.SUSPECT, State.CORDONED, State.DRAINING
        return self._out(device, D, reason, actor, {H: (C, D), S: (C, D), C: (D,)})

    def quarantine(self, device: str, reason: str, actor: str = "operator") -> DeviceRecord:
        """Walk to quarantined (cordoned, draining, quarantined). Refused while a rank is on it:
        drain it and move the rank off first (``assign(device, None)``). No-op if quarantined/retired."""
        H, S, C, D, Q = State.HEALTHY, State.SUSPECT, State.CORDONED, State.DRAINING, State.QUARANTINED
        return self._out(device, Q, reason, actor, {H: (C, D, Q), S: (C, D, Q), C: (D, Q), D: (Q,)},
                         need_idle=True)

    def retire(self, device: str, reason: str, actor: str = "operator") -> DeviceRecord:
        """Out of service for good. No-op if already retired."""
        return self._out(device, State.RETIRED, reason, actor, {})

    def _out(self, device: str, target: State, reason: str, actor: str,
             path: Mapping[State, Iterable[State]], need_idle: bool = False) -> DeviceRecord:
        lifecycle.actor_kind(actor)
        with self._update() as data:
            rec = self._rec(data, device)
            state = State(rec["state"])
            if _DEPTH[state] < _DEPTH[target]:
                if need_idle and rec["rank"] is not None:
                    raise InvalidTransition(
                        f"cannot move {device} from {state} to {target}: rank {rec['rank']} of job "
                        f"{rec['job']} still runs on it; drain it, move the rank off and release it "
                        f"(assign(device, None)) first")
                for step in path.get(state, (target,)):
                    self._move(data, device, step, reason, actor)
        return record_from_json(device, data["devices"][device])

    def uncordon(self, device: str, reason: str = "uncordoned by operator",
                 actor: str = "operator") -> DeviceRecord:
        """Back to service: cordoned -> healthy; draining -> cordoned -> healthy (cancels the drain);
        suspect -> healthy. No-op if healthy. Quarantined devices return only through diagnostics."""
        H, S, C, D = State.HEALTHY, State.SUSPECT, State.CORDONED, State.DRAINING
        with self._update() as data:
            rec = self._rec(data, device)
            for step in {H: (), S: (H,), C: (H,), D: (C, H)}.get(State(rec["state"]), (H,)):
                self._move(data, device, step, reason, actor)
        return record_from_json(device, data["devices"][device])

    # --- diagnostics ---------------------------------------------------------------------------
    def diagnostics_passed(self, device: str, detail: str = "diagnostics passed") -> DeviceRecord:
        """Count one pass; after ``passes_required`` in a row, quarantined -> healthy."""
        with self._update() as data:
            rec = self._rec(data, device)
            if rec["state"] != State.QUARANTINED.value:
                raise InvalidTransition(f"{device} is {rec['state']}, not quarantined: diagnostics "
                                        f"passes count only in quarantine")
            rec["diagnostics_passes"] = int(rec["diagnostics_passes"]) + 1
            if rec["diagnostics_passes"] >= self.passes_required:
                self._move(data, device, State.HEALTHY,
                           f"{detail} ({rec['diagnostics_passes']}/{self.passes_required} in a row)",
                           "diagnostics")
        return record_from_json(device, data["devices"][device])

    def diagnostics_failed(self, device: str, detail: str) -> DeviceRecord:
        """Reset the passes in a row to 0; the device stays quarantined (retire it if it keeps failing)."""
        with self._update() as data:
            rec = self._rec(data, device)
            if rec["state"] != State.QUARANTINED.value:
                raise InvalidTransition(f"{device} is {rec['state']}, not quarantined: diagnostics "
                                        f"results count only in quarantine")
            rec["diagnostics_passes"] = 0
            rec["reason"] = f"diagnostics failed: {detail}"
        return record_from_json(device, data["devices"][device])

    # --- readings, assignment, remediations ------------------------------------------------------
    def record_readings(self, readings: Iterable[Reading]) -> dict[str, DeviceRecord]:
        """Store each reading as its device's last reading from that source, in one write.
        Devices not yet known are registered (healthy): telemetry discovers them. Returns the
        records written, by device."""
        readings = list(readings)
        for r in readings:
            check_device_name(r.device)
        now = self.clock()
        with self._update() as data:
            for r in readings:
                if r.device not in data["devices"]:
                    data["devices"][r.device] = new_record(r.device, State.HEALTHY,
                                                            f"first seen by {r.source}",
                                                            f"source:{r.source}", now)
                rec = data["devices"][r.device]
                rec["readings"][r.source] = {"time": float(r.time), "metrics": storable(r),
                                             "rank": r.rank}
        return {r.device: record_from_json(r.device, data["devices"][r.device]) for r in readings}

    def record_reading(self, reading: Reading) -> DeviceRecord:
        return self.record_readings([reading])[reading.device]

    def assign(self, device: str, rank: int | None, job: str | None = None) -> DeviceRecord:
        """Record which rank of which job runs on the device; ``rank=None`` releases it."""
        if rank is not None and (not isinstance(rank, int) or rank < 0):
            raise ConfigError(f"rank must be a non-negative int or None, got {rank!r}")
        with self._update() as data:
            rec = self._rec(data, device)
            rec["rank"], rec["job"] = rank, (None if rank is None else job)
        return record_from_json(device, data["devices"][device])

    def release(self, device: str) -> DeviceRecord:
        return self.assign(device, None)

    def record_remediation(self, device: str, when: float | None = None) -> DeviceRecord:
        """Count a remediation that was not a rule-driven cordon (those are counted already)."""
        with self._update() as data:
            rec = self._rec(data, device)
            t = self.clock() if when is None else float(when)
            rec["remediations"] = (rec["remediations"] + [t])[-REMEDIATIONS_KEEP:]
        return record_from_json(device, data["devices"][device])

    # --- the desired node states, for the Slurm reconciler ----------------------------------------
    def nodes(self) -> list[str]:
        """Every node that has a device here, sorted."""
        return sorted({d["node"] for d in self._read()["devices"].values()})

    def out_of_service(self) -> dict[str, tuple[tuple[str, str, str], ...]]:
        """Per node, ``(device, state, reason)`` of its out-of-service devices (nodes with none
        are left out): what the node's state in Slurm should say."""
        return out_by_node(self._read()["devices"])

    def slurm_status(self) -> dict[str, SlurmStatus]:
        """What the reconciler last did, per node."""
        return {node: SlurmStatus(node, s.get("want"), s.get("error"), float(s.get("time", 0.0)))
                for node, s in sorted(self._read().get("slurm", {}).items())}

    def record_slurm(self, node: str, want: str | None, error: str | None) -> None:
        """The reconciler's outcome for ``node`` (not a device change: the revision stays)."""
        with self._locked() as data:
            now = data.setdefault("slurm", {}).get(node, {})
            if now.get("want") != want or now.get("error") != error:
                data["slurm"][node] = {"want": want, "error": error, "time": self.clock()}
