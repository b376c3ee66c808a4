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
the metrics (hotspare.observe.metrics.RunMetrics.consume). A sink that raises is dropped with one
line on stderr: watching never stops the training.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable

from hotspare.coordinator import events as ev

Sink = Callable[[dict[str, Any]], None]
_NOISE = frozenset({"step", "joining", "transfer", "reducing"})
DEVICES_EVERY_S = 1.0


class Observer:
    def __init__(self, ledger, view, sinks: list[Sink], health=None, clock: Callable[[], float] = time.time,
                 nodes=None):
        """``ledger``: the run's coordinator.ledger.Ledger; ``view``: its policy view; ``health``:
        its health desk (coordinator.health.HealthMonitor) or None; ``nodes``: its
        coordinator.nodes.Nodes (where each worker runs), or None."""
        self.ledger, self.view, self.health, self.sinks, self.clock = ledger, view, health, list(sinks), clock
        self.nodes = nodes
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
        self.emit(ev.record("run_start", self.clock(), {"job": settings, "schema": ev.SCHEMA}))
        self.sync()

    def on_event(self, event: ev.Event) -> None:
        if self.broken:
            return
        try:
            if not self._noise(event):
                self.emit(ev.to_record(event))
            self.sync(force_devices=isinstance(event, ev.DeviceChecked))
        except Exception as e:     # noqa: BLE001 - watching must never stop the job it watches
            self.broken = True
            print(f"hotspare: the event observer failed and stops ({type(e).__name__}: {e}); the job goes on, "
                  "without metrics or event stream from here", file=sys.stderr, flush=True)

    def close(self, code: int | None, report: dict[str, Any]) -> None:
        """The run ended: the last outcomes, then ``run_end`` with the report's totals."""
        if self.closed or self.broken:
            return
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
        mine = set(self.health.devices)
        devices = [{"device": r.device, "state": r.state.value, "reason": r.reason}
                   for r in self.health.registry.devices() if r.device in mine]
        if devices != self._devices:
            self._devices = devices
            self.emit(ev.record("devices", now, {"devices": devices}))

    # ------------------------------------------------------------------ output
    def emit(self, rec: dict[str, Any]) -> None:
        for sink in list(self.sinks):
            try:
                sink(rec)
            except Exception as e:      # noqa: BLE001 - a broken sink must not stop the job
                self.sinks.remove(sink)
                print(f"hotspare: event sink {getattr(sink, '__qualname__', sink)} failed and is "
                      f"dropped: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
