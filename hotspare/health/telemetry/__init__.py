"""Telemetry sources behind one interface, and the poller that drives them.

    source = auto_source()                      # NVML where GPUs are, else simulated CPU devices
    with Poller(source, handle, period_s=5.0):  # handle(list[Reading]) runs in the poller thread
        ...

``NvmlSource`` reads real GPUs; ``SimulatedSource`` presents CPU devices whose readings the fault
injector drives (``source.apply("host/cpu1", "thermal", temp=92)``).
"""
from __future__ import annotations

from hotspare.health.telemetry.base import (
    DEVICE_ERROR,
    MONITOR_UNRESPONSIVE,
    TelemetrySource,
    default_node,
)
from hotspare.health.telemetry.nvml import NvmlSource
from hotspare.health.telemetry.poller import DEFAULT_PERIOD_S, Poller
from hotspare.health.telemetry.simulated import FAULTS, SimulatedSource


def auto_source(node: str | None = None, simulated_devices: int = 2) -> TelemetrySource:
    """NVML when it can read at least one GPU here; otherwise ``simulated_devices`` simulated ones.

    The choice shows in ``source.name`` ("nvml" or "simulated") and ``source.status()``.
    """
    nvml = NvmlSource(node)
    ok, why = nvml.status()
    if ok:
        return nvml
    sim = SimulatedSource(simulated_devices, node)
    sim.fallback_reason = why
    return sim


__all__ = [
    "DEFAULT_PERIOD_S",
    "DEVICE_ERROR",
    "FAULTS",
    "MONITOR_UNRESPONSIVE",
    "NvmlSource",
    "Poller",
    "SimulatedSource",
    "TelemetrySource",
    "auto_source",
    "default_node",
]
