"""The coordinator service's dashboard (``hotspare coordinator --dashboard ADDR:PORT``): the
cluster as the service sees it, and the operator's cordon, drain and uncordon.

- ``ClusterFeed`` reads the service's hosts (its database: each host's devices and phase) and the
  device registry (each device's lifecycle state and reason) about once a second and gives the
  dashboard a ``cluster`` record when anything changed; the page colours its grid from those
  records only, so a tile changes colour when the registry changed, not when a button was pressed.
- ``Operator`` carries out a confirmed request of the page. It makes the move the ``hotspare
  cordon`` / ``drain`` / ``uncordon`` commands make: the registry's own walk along the lifecycle
  table (``Registry.cordon``/``drain``/``uncordon``, actor "operator"), in the database the service
  and every job it runs read. What follows is theirs, as after the command: placement gives no new
  work to a device out of service, a running job's health desk live-migrates the rank off a drained
  device at the next step boundary, Slurm is told (the service's reconciler, at once here).

The dashboard's HTTP side (login, confirmation, CSRF nonce, refusals, logging) is
hotspare/observe/dashboard.py; nothing here trusts the request beyond the names it checks.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from hotspare.coordinator import events as ev
from hotspare.errors import ConfigError, HotspareError
from hotspare.health.lifecycle import State
from hotspare.health.types import node_of

ACTIONS = ("cordon", "drain", "uncordon")
POLL_S = 1.0
REASON_MAX = 200
# What a device of a registered host that the registry has not seen yet counts as: placement
# takes it (hotspare.service.service.Service.in_service), so the page shows it in service.
UNSEEN = {"state": State.HEALTHY.value, "reason": "no health record yet (in service)"}


def cluster_data(hosts: list[dict[str, Any]], records) -> dict[str, Any]:
    """The ``cluster`` record's data from the service's hosts and the registry's records: every
    host with its phase and devices, every device with its lifecycle state."""
    known = {r.device: r for r in records}
    devices, seen = [], set()
    for h in hosts:
        for d in h["devices"]:
            seen.add(d)
            r = known.get(d)
            devices.append({"device": d, "host": h["name"], **(
                {"state": r.state.value, "reason": r.reason, "rank": r.rank, "job": r.job} if r else
                {**UNSEEN, "rank": None, "job": None})})
    for d, r in sorted(known.items()):          # in the registry, its host not (or no longer) registered
        if d not in seen:
            devices.append({"device": d, "host": r.node, "state": r.state.value, "reason": r.reason,
                            "rank": r.rank, "job": r.job})
    return {"hosts": [{"name": h["name"], "phase": h["state"], "spare": h["spare"], "devices": h["devices"]}
                      for h in hosts], "devices": devices}


class ClusterFeed:
    """A thread giving ``sink`` a ``cluster`` record at start and whenever the hosts or the
    registry changed (looked at every ``period`` seconds; ``poke`` looks at once)."""

    def __init__(self, hosts: Callable[[], list[dict[str, Any]]], registry, sink: Callable[[dict], None],
                 period: float = POLL_S, log: Callable[[str], None] = print):
        self.hosts, self.registry, self.sink, self.period, self.log = hosts, registry, sink, period, log
        self._last: dict[str, Any] | None = None
        self._wake, self._stop = threading.Event(), threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="dashboard-cluster", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.look()
            self._wake.wait(self.period)
            self._wake.clear()

    def look(self) -> None:
        try:
            data = cluster_data(self.hosts(), self.registry.devices())
        except (HotspareError, OSError) as e:       # e.g. out of file descriptors for a moment
            if not self._failing:
                self.log(f"DASHBOARD cannot read the hosts or the device registry this time: {e}")
            self._failing = True
            return
        self._failing = False
        if data != self._last:
            self._last = data
            self.sink(ev.record("cluster", time.time(), data))

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5.0)


class Operator:
    """Cordon, drain or uncordon a device, or every device of a host, for the dashboard."""

    def __init__(self, hosts: Callable[[], list[dict[str, Any]]], registry, reconciler=None,
                 changed: Callable[[], None] = lambda: None):
        self.hosts, self.registry, self.reconciler, self.changed = hosts, registry, reconciler, changed

    def devices_of(self, target: str) -> list[str]:
        """The devices ``target`` names: a device (of a registered host, or in the registry) or
        a registered host (all its devices). ``ConfigError`` for anything else."""
        hosts = self.hosts()
        for h in hosts:
            if h["name"] == target:
                if not h["devices"]:
                    raise ConfigError(f"host {target} has no devices")
                return list(h["devices"])
            if target in h["devices"]:
                return [target]
        if self.registry.find(target) is not None:
            return [target]
        raise ConfigError(f"no host or device named {target[:64]!r} here")

    def apply(self, action: str, target: str, reason: str) -> dict[str, Any]:
        """Make the move on every device of ``target``; what each was and is now. ``ConfigError``
        (nothing changed) for an unknown target or action; a move the lifecycle does not allow
        (uncordoning a quarantined device) stops there, with the devices moved before it said."""
        if action not in ACTIONS:
            raise ConfigError(f"unknown action {action[:32]!r}: {', '.join(ACTIONS)}")
        devices = self.devices_of(target)
        moved = []
        try:
            for device in devices:
                before = self.registry.ensure(device, reason="registered by its host's agent")
                if action == "uncordon" and before.state is State.QUARANTINED:
                    raise ConfigError(
                        f"{device} is quarantined ({before.reason}): it returns to service only after passing "
                        f"the quarantine diagnostics {self.registry.passes_required} times in a row "
                        f"({before.diagnostics_passes} so far)")
                after = getattr(self.registry, action)(device, reason=reason, actor="operator")
                moved.append({"device": device, "from": before.state.value, "to": after.state.value})
        except (HotspareError, ValueError) as e:
            if not moved:
                raise
            done = ", ".join(f"{m['device']} {m['from']} -> {m['to']}" for m in moved)
            raise ConfigError(f"{done}; then: {e}") from None
        finally:
            if moved:
                self.changed()
        notes = []
        if self.reconciler is not None:        # Slurm follows the registry, as after `hotspare cordon`
            try:
                notes = list(self.reconciler.reconcile(sorted({node_of(d) for d in devices})).notes)
            except HotspareError as e:
                notes = [f"Slurm not updated yet (the service retries): {e}"]
        return {"action": action, "target": target, "moved": moved, "notes": notes}
