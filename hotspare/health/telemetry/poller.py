"""Poll a telemetry source from a background thread and hand the readings to a callback.

Every ``period_s`` the poller calls ``source.poll()`` in a helper thread and waits for it. A call
that raises, or has not returned after ``3 x period_s`` (rule 30 of the reference table: a wedged
driver is likely), is reported as readings that carry ``monitor_unresponsive`` (a string saying
why) and ``monitor_stalled_periods`` (how long the call has hung, in poll periods; 0 for a call
that raised) for each device the source last named; while a call stays stuck that report repeats
every period, and no second call is started. When the stuck call finally returns, its readings are
delivered late and the source counts as responsive again. Readings of a call that answered carry
``monitor_unresponsive = ""`` and ``monitor_stalled_periods = 0``, so a rule on them sees the
monitor's current state. Nothing the source or the callback
does stops the poller; only :meth:`Poller.stop` does.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from hotspare.errors import ConfigError
from hotspare.health.telemetry.base import MONITOR_UNRESPONSIVE, TelemetrySource
from hotspare.health.types import MONITOR_STALLED_PERIODS, Reading

log = logging.getLogger("hotspare.health")

DEFAULT_PERIOD_S = 5.0
UNRESPONSIVE_PERIODS = 3.0     # rule 30: longer than 3 x the poll interval


class _Call(threading.Thread):
    def __init__(self, fn):
        super().__init__(name="hotspare-poll-call", daemon=True)
        self.fn, self.result, self.error = fn, None, None
        self.done = threading.Event()

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - reported, never propagated
            self.error = e
        finally:
            self.done.set()


class Poller:
    """Polls ``source`` every ``period_s`` seconds and calls ``on_readings(list[Reading])``.

    Use as a context manager or call :meth:`start` / :meth:`stop`. ``unresponsive_after_s``
    defaults to ``3 * period_s``.
    """

    def __init__(self, source: TelemetrySource, on_readings: Callable[[list[Reading]], None], *,
                 period_s: float = DEFAULT_PERIOD_S, unresponsive_after_s: float | None = None):
        if not period_s > 0:
            raise ConfigError(f"poll period must be > 0 seconds, got {period_s!r}")
        self.source = source
        self.on_readings = on_readings
        self.period_s = float(period_s)
        self.unresponsive_after_s = (float(unresponsive_after_s) if unresponsive_after_s is not None
                                     else UNRESPONSIVE_PERIODS * self.period_s)
        if not self.unresponsive_after_s > 0:
            raise ConfigError(f"unresponsive_after_s must be > 0, got {unresponsive_after_s!r}")
        self.polls = 0                    # calls that returned readings
        self.failures = 0                 # reports of an unresponsive source
        self.unresponsive: str | None = None   # the current reason, None while the source answers
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self._devices = list(source.devices())
        except Exception as e:  # noqa: BLE001
            log.warning("telemetry %s: devices() raised %s; devices are learnt from readings", source.name, e)
            self._devices = []

    def start(self) -> Poller:
        if self._thread is not None:
            raise RuntimeError("poller already started")
        self._thread = threading.Thread(target=self._run, name=f"hotspare-poller-{self.source.name}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> Poller:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --------------------------------------------------------------------------------------------
    def _deliver(self, readings: list[Reading]) -> None:
        try:
            self.on_readings(readings)
        except Exception:  # noqa: BLE001 - a broken consumer must not stop the polling
            log.exception("telemetry %s: the readings callback raised", self.source.name)

    def _report(self, reason: str, stalled_s: float = 0.0) -> None:
        self.failures += 1
        if self.unresponsive is None:
            log.warning("telemetry %s unresponsive: %s", self.source.name, reason)
        self.unresponsive = reason
        now = time.time()
        metrics = {MONITOR_UNRESPONSIVE: reason, MONITOR_STALLED_PERIODS: round(stalled_s / self.period_s, 2)}
        self._deliver([Reading(device=d, time=now, source=self.source.name, metrics=dict(metrics))
                       for d in self._devices])

    def _run(self) -> None:
        name = self.source.name
        while not self._stop.is_set():
            t0 = time.monotonic()
            call = _Call(self.source.poll)
            call.start()
            deadline = t0 + self.unresponsive_after_s
            while not call.done.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
                if self._stop.is_set():
                    return
                if time.monotonic() >= deadline:
                    waited = time.monotonic() - t0
                    self._report(f"{name} poll() has not returned after {waited:.2f} s "
                                 f"(limit {self.unresponsive_after_s:g} s = "
                                 f"{self.unresponsive_after_s / self.period_s:g} x the {self.period_s:g} s period)",
                                 waited)
                    deadline = time.monotonic() + self.period_s
            if call.error is not None:
                e = call.error
                self._report(f"{name} poll() raised {type(e).__name__}: {e}")
            else:
                # "answering": so rules on the monitor's own health read the current state, not
                # the last report of a stall
                fine = {MONITOR_UNRESPONSIVE: "", MONITOR_STALLED_PERIODS: 0.0}
                readings = [dataclasses.replace(r, metrics={**r.metrics, **fine}) for r in call.result or []]
                if self.unresponsive is not None:
                    log.warning("telemetry %s answers again after %.2f s", name, time.monotonic() - t0)
                self.unresponsive = None
                self.polls += 1
                if readings:
                    known = {r.device for r in readings}
                    self._devices += [d for d in sorted(known) if d not in self._devices]
                self._deliver(readings)
            # next tick one period after this one started; a slow poll is followed at once
            self._stop.wait(max(0.0, t0 + self.period_s - time.monotonic()))
