"""A remote node's own device telemetry: polled on its host, sent up over its uplink.

A ``hotspare agent`` on another host polls that host's devices itself (the launcher cannot):
NVML for GPU slots (``--devices gpu``), else a ``SimulatedSource`` for its ``cpu:N`` slots,
named ``NODE/cpu0``... as the slots are, and said to be simulated in the agent's log. Every
``telemetry_period`` seconds (from the launcher's welcome; 0 or absent: no polling) the
readings of the node's own slots go up as one ``readings`` message (``hotspare.protocol.messages``;
chunks of at most ``CHUNK``), which the launcher's node endpoint turns into the coordinator's
``Readings`` event once it has checked that every device named is this node's.

Before a quarantine diagnostics pass (the ``diagnose`` command, ``hotspare.agent.checks``) the
device is reset here on the first pass (a simulated device reads nominal again, as after a GPU
reset) and a fresh poll goes up before the checks start, so the coordinator judges the
device's telemetry as it was when its checks began. With ``--allow-inject`` the fault
plug-in's device faults drive this host's simulated devices.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable

from hotspare.errors import ConfigError, ProtocolError
from hotspare.health.telemetry import NvmlSource, Poller, SimulatedSource, TelemetrySource
from hotspare.health.types import XIDS, Reading
from hotspare.protocol.messages import MAX_METRICS, MAX_NAME, MAX_XIDS

CHUNK = 256           # readings per message (the schema allows up to MAX_ITEMS)
PREPARE_POLL_S = 5.0  # a poll before diagnostics waits at most this long (a wedged driver must not hold the agent)


def node_source(node: str, devices: list[str], nvml_lib=None) -> tuple[TelemetrySource | None, str]:
    """The telemetry source for this node's slots, and what to say about it: NVML when the
    slots are GPUs, a simulated source when they are CPU slots, None for no slots.
    ``nvml_lib``: pynvml's functions, for tests (``NvmlSource(lib=...)``)."""
    gpus = [d for d in devices if d.split("/", 1)[-1].startswith("gpu")]
    cpus = [d for d in devices if d.split("/", 1)[-1].startswith("cpu")]
    if gpus:
        source = NvmlSource(node, lib=nvml_lib)
        ok, why = source.status()
        if not ok:
            source.close()
            return None, f"telemetry: none ({why})"
        return source, f"telemetry: {why}"
    if cpus:
        source = SimulatedSource(len(cpus), node)
        if source.devices() != cpus:
            raise ConfigError(f"device slots {cpus} are not {node}/cpu0..: name them with --devices cpu:N")
        return source, (f"telemetry: SIMULATED readings of {len(cpus)} cpu slot(s) (no GPU slots here); "
                        "they change only by fault injection")
    return None, "telemetry: none (no device slots)"


def wire(reading: Reading) -> dict[str, Any] | None:
    """One reading as the ``readings`` message carries it: plain JSON, finite, bounded; None
    when nothing of it is sendable."""
    metrics: dict[str, Any] = {}
    for key, value in list(reading.metrics.items())[:MAX_METRICS]:
        if key == XIDS:
            metrics[key] = [int(x) for x in value][:MAX_XIDS]
        elif isinstance(value, str):
            metrics[key] = value[:MAX_NAME]
        elif isinstance(value, (bool, int)) or (isinstance(value, float) and math.isfinite(value)):
            metrics[key] = value
    if not metrics or not math.isfinite(reading.time):
        return None
    return {"device": reading.device, "time": reading.time, "source": reading.source, "metrics": metrics}


class NodeTelemetry:
    """This host's telemetry for its agent: ``start(agent, period)`` once a job's agent runs,
    ``stop()`` when its part of the job ends (a pooled agent works for one job after another),
    ``close()`` at the end. ``allow_inject``: each job's agent gets the fault plug-in
    (``job_faults``), its device faults driving the simulated source."""

    def __init__(self, node: str, devices: list[str], say: Callable[[str], None], allow_inject: bool = False):
        self.node, self.devices, self.say = node, list(devices), say
        self.source, self.detail = node_source(node, self.devices)
        self.poller: Poller | None = None
        self._report: Callable[..., None] | None = None
        self.allow_inject = allow_inject

    @property
    def device_faults(self) -> bool:
        """Can injected device faults drive this node's telemetry? (simulated devices only)"""
        return isinstance(self.source, SimulatedSource)

    @property
    def injectable(self) -> bool:
        """Does this node carry out injected device faults? (what its hello says)"""
        return self.allow_inject and self.device_faults

    def job_faults(self):
        """The fault plug-in for one job's agent (``hotspare.testing.faults.AgentFaults``, its
        own armed faults), or None when this host's operator did not allow injection."""
        if not self.allow_inject:
            return None
        from hotspare.testing.faults import AgentFaults     # a testing plug-in, loaded only when allowed
        return AgentFaults(self.device_fault if self.device_faults else None)

    def start(self, agent, period: Any) -> None:
        """Poll every ``period`` seconds (the welcome's ``telemetry_period``) and send the
        readings through ``agent.report``; prepare the agent's diagnostics passes."""
        self._report = agent.report
        agent.checks.prepare = self.prepare
        wanted = type(period) in (int, float) and period > 0
        if self.source is None or not wanted:
            self.say(self.detail if self.source is None
                     else f"{self.detail}; not polled: the job's telemetry is off")
            return
        self.poller = Poller(self.source, self.send, period_s=float(period))
        self.poller.start()
        self.say(f"{self.detail}; polled every {float(period):g} s, sent to the coordinator")

    def stop(self) -> None:
        """The job's part on this node ended: no more polls for it."""
        if self.poller is not None:
            self.poller.stop()
            self.poller = None

    def send(self, readings: list[Reading]) -> None:
        """The readings of this node's own slots, up to the coordinator."""
        items = [item for r in readings if r.device in self.devices and (item := wire(r)) is not None]
        if self._report is None:
            return
        for i in range(0, len(items), CHUNK):
            try:
                self._report("readings", readings=items[i:i + CHUNK])
            except ProtocolError as e:     # one unsendable poll: said here, polling goes on
                self.say(f"telemetry: a poll could not be sent: {e}")

    def prepare(self, device: str, reset: bool) -> None:
        """Before a diagnostics pass of ``device``: reset it (first pass), then send a fresh poll."""
        if reset and isinstance(self.source, SimulatedSource):
            self.source.clear(device)
        self.say(f"QUARANTINE {device}: diagnostics pass starting on this node"
                 + (", after a reset (simulated: nominal readings again)" if reset and self.device_faults else ""))
        if self.source is None:
            return
        done: list[list[Reading]] = []
        poll = threading.Thread(target=lambda: done.append(self.source.poll()), daemon=True,
                                name="agent-telemetry-prepare")
        poll.start()
        poll.join(PREPARE_POLL_S)
        if not done:
            self.say(f"QUARANTINE {device}: its telemetry did not answer within {PREPARE_POLL_S:g} s")
            return
        self.send([r for r in done[0] if r.device == device])

    def device_fault(self, device: str, fault) -> None:
        """An injected device fault (``hotspare.testing.faults``) on this host's simulated device."""
        self.source.apply(device, fault.kind, **fault.params)
        self.say(f"FAULT   {fault}: the simulated telemetry of {device} now reads it")

    def close(self) -> None:
        self.stop()
        if self.source is not None:
            self.source.close()
