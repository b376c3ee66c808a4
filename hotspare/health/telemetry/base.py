"""The one interface every telemetry source implements, and the names a source adds.

A source is polled by :class:`hotspare.health.telemetry.poller.Poller` from a background
thread. Contract:

* ``status()`` never raises; it says whether the source can read anything and, if not, why.
* ``devices()`` never blocks (it answers from what the source already knows), so the poller can
  still name the devices of a source whose ``poll()`` is wedged.
* ``poll()`` returns one :class:`~hotspare.health.types.Reading` per device it could read, with
  only the metrics it could read (names from ``hotspare.health.types``). A device that fails is
  left out or reported with :data:`DEVICE_ERROR`; it never makes the whole poll raise.
"""
from __future__ import annotations

import abc
import socket

# DEVICE_ERROR and MONITOR_UNRESPONSIVE are the two metrics the telemetry layer itself reports
# (rule 3's "NVML GPU_IS_LOST errors" and rule 30 of the reference table); defined with the
# vocabulary, re-exported here.
from hotspare.health.types import DEVICE_ERROR, MONITOR_UNRESPONSIVE, Reading  # noqa: F401


def default_node() -> str:
    """The short host name, as Slurm names the node."""
    return socket.gethostname().split(".", 1)[0]


class TelemetrySource(abc.ABC):
    """A source of device readings: NVML on GPU machines, the simulated source elsewhere."""

    name: str = "?"

    @abc.abstractmethod
    def status(self) -> tuple[bool, str]:
        """``(available, detail)``; never raises. ``detail`` explains an unavailable source."""

    @abc.abstractmethod
    def devices(self) -> list[str]:
        """Device names ``"<node>/<kind><index>"`` this source reports on; never blocks."""

    @abc.abstractmethod
    def poll(self) -> list[Reading]:
        """One reading per readable device; ``[]`` when the source is unavailable."""

    def close(self) -> None:
        """Release what the source holds (library handles, event sets). Idempotent."""
