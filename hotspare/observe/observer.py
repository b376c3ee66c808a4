"""The observer: one subscriber to a coordinator's typed events that turns them, and what the
ledger made of them, into the event stream's records (schema: hotspare.coordinator.events).

It listens on every event type through the coordinator's listener seam (after the coordinator
handled the event), writes the event's own record, then compares the ledger and the view with
what it last saw and writes the outcomes (each at most once, stamped with the ledger's own
times, so a late look changes no number):

- ``failure``: a member was lost (its failure record as the report has it, still open);
- ``failover``: the generation that replaces it formed: ``recovery_path``, ``lost_steps``...;
- ``recovered``: every rank of that generation committed a step: ``downtime_s``, ``phases_s``;
- ``unrecovered``: the job stopped with the failure open;
- ``generation``: a generation formed (``gen``, ``world_size``, the steps it lost, counted once);
- ``migration`` (finished one way or another), ``checkpoint_fallback``, ``health_event``;
- ``devices`` (each device's lifecycle state, when one changed), ``spares`` (ready and starting),
  ``steps_repeated`` (when the count grew); ``run_start`` and ``run_end`` (with the report's totals).

High-rate worker messages (fault triggers, "reducing" answers, the commits of ranks other than
0) are left out of the stream: rank 0 reports each commit at once, with the script's metrics
(``job.log(loss=...)``), which is what a loss curve and the step time need.

Sinks are callables taking a record: the JSON-lines file (hotspare.observe.stream.EventFile),
the metrics (hotspare.observe.metrics.RunMetrics.consume). Watching never stops the training:

- the device registry it cannot read (``EMFILE`` while the launcher is out of file descriptors,
  a registry being replaced, a corrupt one): that look is skipped, said on stderr once and then
  at most once per ``COMPLAIN_EVERY_S`` with the count, and tried again ``DEVICES_EVERY_S`` later;
- a sink that raises ``OSError`` for want of a resource (``TRANSIENT``: ``EMFILE``, ``ENFILE``,
  ``ENOBUFS``, ``ENOMEM``) stays and is given the next record, said the same way;
- a sink that raises anything else is dropped with one line on stderr;
- anything else the observer itself raises (in ``start``, an event, ``close``) stops it, with
  one line on stderr; the job goes on without metrics or event stream from there.
"""
from __future__ import annotations

import errno
import sys
import time
from typing import Any, Callable

from hotspare.coordinator import events as ev
from hotspare.health.registry import RegistryError

Sink = Callable[[dict[str, Any]], None]
_NOISE = frozenset({"step", "joining", "transfer", "reducing"})
DEVICES_EVERY_S = 1.0
COMPLAIN_EVERY_S = 60.0
TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def _say(line: str) -> None:
    print(f"hotspare: {line}", file=sys.stderr, flush=True)


class Complaints:
    """Troubles that may last (one per ``key``): the first said at once, then at most one line
    per ``every`` seconds with how many there were since; ``over(key)`` says when it went away."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, every: float = COMPLAIN_EVERY_S,
                 say: Callable[[str], None] = _say):
        self.clock, self.every, self.say = clock, every, say
        self._open: dict[Any, list[float]] = {}         # key -> [said at, count since, count in all]

    def __call__(self, key: Any, line: str) -> None:
        now = self.clock()
        c = self._open.get(key)
        if c is None:
            self._open[key] = [now, 0, 1]
            self.say(line)
            return
        c[1] += 1
        c[2] += 1
        if now - c[0] >= self.every:
            self.say(f"{line} ({c[1]} more since the last line)")
            c[0], c[1] = now, 0

    def __contains__(self, key: object) -> bool:
        return key in self._open

    def over(self, key: Any, line: str) -> None:
        c = self._open.pop(key, None)
        if c is not None:
            self.say(f"{line} ({c[2]} time(s) in all)")


class Observer:
    def __init__(self, ledger, view, sinks: list[Sink], health=None, clock: Callable[[], float] = time.time,
                 nodes=None, complaints: Complaints | None = None):
        """``ledger``: the run's coordinator.ledger.Ledger; ``view``: its policy view; ``health``:
        its health desk (coordinator.health.HealthMonitor) or None; ``nodes``: its
        coordinator.nodes.Nodes (where each worker runs), or None; ``complaints``: how troubles
        that may last are said (on stderr, rate-limited)."""
        self.ledger, self.view, self.health, self.sinks, self.clock = ledger, view, health, list(sinks), clock
        self.nodes = nodes
        self.complain = complaints if complaints is not None else Complaints()
        self._failures = 0                      # failure records announced
        self._stage: dict[int, int] = {}        # failure index -> 1 failover said, 2 outcome said
        self._migrations = self._fallbacks = self._health_events = 0
        self._migration_said: set[int] = set()
        self._gen = 0
        self._repeated = 0
        self._spares: tuple[int, int] | None = None
        self._devices: list[dict[str, Any]] | None = None
        self._devices_at = 0.0
        self.closed = self.broken = False

    def install(self, coordinator) -> "Observer":
        for cls in ev.EVENT_KINDS.values():
            coordinator.listen(cls, self.on_event)
        return self

    # ------------------------------------------------------------------ input
    def start(self, settings: dict[str, Any]) -> None:
        self._guarded(self._start, settings)

    def on_event(self, event: ev.Event) -> None:
        self._guarded(self._on_event, event)

    def close(self, code: int | None, report: dict[str, Any]) -> None:
        """The run ended: the last outcomes, then ``run_end`` with the report's totals."""
        self._guarded(self._close, code, report)

    def _guarded(self, step: Callable[..., None], *args: Any) -> None:
        if self.broken or self.closed:
            return
        try:
            step(*args)
        except Exception as e:     # noqa: BLE001 - watching must never stop the job it watches
            self.broken = True
            _say(f"the event observer failed and stops ({type(e).__name__}: {e}); the job goes on, "
                 "without metrics or event stream from here")

    def _start(self, settings: dict[str, Any]) -> None:
        self.emit(ev.record("run_start", self.clock(), {"job": settings, "schema": ev.SCHEMA}))
        self.sync()

    def _on_event(self, event: ev.Event) -> None:
        if not self._noise(event):
            self.emit(ev.to_record(event))
        self.sync(force_devices=isinstance(event, ev.DeviceChecked))

    def _close(self, code: int | None, report: dict[str, Any]) -> None:
        self.sync(force_devices=True)
        keys = ("outcome", "message", "steps_completed", "total_steps", "failures_total", "recovered_zero_loss",
                "recovered_from_checkpoint", "steps_lost", "steps_repeated", "zero_loss_share",
                "final_state_digest", "wall_time_s", "median_step_time_s", "migrations_total")
        self.emit(ev.record("run_end", self.clock(), {"exit_code": code, **{k: report.get(k) for k in keys}}))
        self.closed = True

    @staticmethod
    def _noise(event: ev.Event) -> bool:
        if not isinstance(event, ev.WorkerSaid):
            return False
        return event.type in _NOISE or (event.type == "commit" and event.msg.get("rank") != 0)

    # ------------------------------------------------------------------ outcomes
    def sync(self, force_devices: bool = False) -> None:
        """Write the outcomes the ledger and the view hold that were not written yet."""
        L, now = self.ledger, self.clock()
        for i in range(self._failures, len(L.failures)):
            f = L.failures[i]
            self.emit(ev.record("failure", f.detected_at, f.to_dict()))
        self._failures = len(L.failures)
        formed = self.view.generation != self._gen
        for i, f in enumerate(L.failures):
            stage = self._stage.get(i, 0)
            if stage == 2:
                continue
            if stage == 0 and f.generation is not None:
                self.emit(ev.record("failover", f.decided_at or now, f.to_dict()))
                stage = 1
            if f.first_commit_at is not None:
                self.emit(ev.record("recovered", f.first_commit_at, f.to_dict()))
                stage = 2
            elif f.recovery_path == "stopped":
                self.emit(ev.record("unrecovered", now, f.to_dict()))
                stage = 2
            self._stage[i] = stage
        if formed:
            self._gen = gen = self.view.generation
            mine = [f for f in L.failures if f.generation == gen]
            self.emit(ev.record("generation", now, {
                "gen": gen, "world_size": self.view.world_size, "members": len(self.view.members),
                "failures": len(mine), "lost_steps": max((f.lost_steps or 0 for f in mine), default=0),
                "restore": any(f.recovery_path == "checkpoint" for f in mine),
                "placement": [self._where(r, w) for r, w in sorted(self.view.members.items())]}))
        for i, m in enumerate(L.migrations):
            if i not in self._migration_said and m.outcome != "in flight":
                self._migration_said.add(i)
                self.emit(ev.record("migration", m.first_commit_at or now, m.to_dict()))
        for fb in L.checkpoint_fallbacks[self._fallbacks:]:
            self.emit(ev.record("checkpoint_fallback", now, dict(fb)))
        self._fallbacks = len(L.checkpoint_fallbacks)
        for he in L.health_events[self._health_events:]:
            self.emit(ev.record("health_event", L.started + he.get("time", 0.0), dict(he)))
            force_devices = True
        self._health_events = len(L.health_events)
        if len(L.repeated) != self._repeated:
            self._repeated = len(L.repeated)
            self.emit(ev.record("steps_repeated", now, {"total": self._repeated}))
        spares = (len(self.view.ready_spares), self.view.starting)
        if spares != self._spares:
            self._spares = spares
            self.emit(ev.record("spares", now, {"ready": spares[0], "starting": spares[1],
                                                "workers": [self._where(None, w) for w in self.view.ready_spares]}))
        self._sync_devices(now, force_devices)

    def _where(self, rank: int | None, worker: str) -> dict[str, Any]:
        wp = self.nodes.workers.get(worker) if self.nodes is not None else None
        return {"rank": rank, "worker": worker, "node": wp.node if wp else None, "device": wp.device if wp else None}

    def _sync_devices(self, now: float, force: bool) -> None:
        if self.health is None or (not force and now - self._devices_at < DEVICES_EVERY_S):
            return
        self._devices_at = now
        try:
            records = self.health.registry.devices()
        except (OSError, RegistryError) as e:     # EMFILE, a registry being replaced or broken
            self.complain("registry", f"the event observer cannot read the device registry ({e}); device "
                                      "states are left out of the event stream until it can; the job goes on")
            return
        self.complain.over("registry", "the event observer reads the device registry again")
        mine = set(self.health.devices)
        devices = [{"device": r.device, "state": r.state.value, "reason": r.reason}
                   for r in records if r.device in mine]
        if devices != self._devices:
            self._devices = devices
            self.emit(ev.record("devices", now, {"devices": devices}))

    # ------------------------------------------------------------------ output
    def emit(self, rec: dict[str, Any]) -> None:
        for sink in list(self.sinks):
            name = getattr(sink, "__qualname__", None) or type(sink).__name__
            try:
                sink(rec)
            except OSError as e:
                if e.errno not in TRANSIENT:
                    self._drop(sink, name, e)
                    continue
                self.complain(("sink", id(sink)), f"event sink {name} failed for want of a resource ({e}); "
                                                  "it is kept and given the next record")
            except Exception as e:      # noqa: BLE001 - a broken sink must not stop the job
                self._drop(sink, name, e)
            else:
                if ("sink", id(sink)) in self.complain:
                    self.complain.over(("sink", id(sink)), f"event sink {name} takes records again")

    def _drop(self, sink: Sink, name: str, e: Exception) -> None:
        self.sinks.remove(sink)
        _say(f"event sink {name} failed and is dropped: {type(e).__name__}: {e}")
