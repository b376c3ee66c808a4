"""Device checks as node-agent commands: admission and quarantine diagnostics run on the node
that holds the devices, never in the coordinator.

The coordinator's health desk (``hotspare.coordinator.health``) sends

  ``admit``     {devices, size}   admission checks of these devices, in one device group
  ``diagnose``  {device, size}    one pass of quarantine diagnostics of one device

and the agent answers each device with one ``checked`` message {device, stage, passed,
cancelled, detail}. The checks themselves run in check worker processes
(``hotspare.health.checks.runner``), from a thread of the agent, so its command loop goes on
meanwhile; this process imports no torch for them. Closing the agent (its ``shutdown``) cuts
running checks short: their workers are killed, and the answer says ``cancelled`` (the device
stays quarantined; the next job's desk diagnoses it again).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from hotspare.errors import ProtocolError
from hotspare.health.checks.admission import admit_devices
from hotspare.health.checks.quarantine import diagnose_devices
from hotspare.health.checks.result import DeviceReport
from hotspare.health.types import split_device

STAGES = ("admission", "quarantine")


def summary(report: DeviceReport) -> str:
    """One line for the coordinator's log and the registry: what failed, or what passed."""
    if not report.passed:
        return "; ".join(report.reasons)
    return "; ".join(f"{r.name} {'skipped' if r.skipped else 'ok'}" for r in report.results)


class NodeChecks:
    """The agent's ``admit`` and ``diagnose`` commands. ``report(type, **fields)`` sends a
    message up to the coordinator."""

    def __init__(self, devices: list[str], report: Callable[..., None]):
        self.devices = list(devices)
        self.report = report
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._running: dict[str, threading.Thread] = {}     # device -> the check that holds it
        # prepare(device, reset): before a diagnostics pass starts, e.g. the node's telemetry resets
        # the device (reset: the first pass) and sends a fresh poll up (hotspare.agent.telemetry)
        self.prepare: Callable[[str, bool], None] | None = None

    def commands(self) -> dict[str, Callable[[dict[str, Any]], None]]:
        return {"admit": lambda m: self.admit(list(m["devices"]), m["size"]),
                "diagnose": lambda m: self.diagnose(m["device"], m["size"], m.get("reset") is True)}

    def admit(self, devices: list[str], size: str) -> None:
        parsed = self._own(devices)
        if len({kind for _d, kind, _i in parsed}) != 1:
            raise ProtocolError(f"admit: one device kind per command, got {devices}")
        self._start(devices, "admission", lambda: admit_devices(parsed, size=size, progress=_quiet,
                                                                 stop=self.stop))

    def diagnose(self, device: str, size: str, reset: bool = False) -> None:
        parsed = self._own([device])
        if self.prepare is not None and not self.stop.is_set():
            self.prepare(device, reset)
        self._start([device], "quarantine", lambda: diagnose_devices(parsed, size=size, progress=_quiet,
                                                                      stop=self.stop))

    def busy(self) -> list[str]:
        """The devices a check is running on."""
        with self._lock:
            return sorted(self._running)

    def close(self, timeout: float = 30.0) -> None:
        """Cut running checks short and wait (at most ``timeout`` s) for their workers to go."""
        self.stop.set()
        with self._lock:
            threads = set(self._running.values())
        for thread in threads:
            thread.join(timeout)

    # ------------------------------------------------------------------ internals
    def _own(self, devices: list[str]) -> list[tuple[str, str, int]]:
        if not devices:
            raise ProtocolError("name at least one device to check")
        out = []
        for device in devices:
            if device not in self.devices:
                raise ProtocolError(f"device {device!r} is not one of this node's: {self.devices}")
            try:
                _node, kind, index = split_device(device)
            except ValueError as e:
                raise ProtocolError(str(e)) from None
            out.append((device, kind, index))
        if len(set(devices)) != len(devices):
            raise ProtocolError("a device is named twice")
        return out

    def _start(self, devices: list[str], stage: str, run: Callable[[], list[DeviceReport]]) -> None:
        if self.stop.is_set():
            raise ProtocolError("the agent is closing: no checks start")
        thread = threading.Thread(target=self._run, args=(devices, stage, run), daemon=True,
                                  name=f"check-{stage}-{devices[0]}")
        with self._lock:
            held = [d for d in devices if d in self._running]
            if held:
                raise ProtocolError(f"a check is already running on {', '.join(held)}")
            for d in devices:
                self._running[d] = thread
        thread.start()

    def _run(self, devices: list[str], stage: str, run: Callable[[], list[DeviceReport]]) -> None:
        try:
            try:
                reports = {r.device: r for r in run()}
                why = "the checks did not report on it"
            except Exception as e:  # noqa: BLE001 - the answer says why; the agent goes on
                reports, why = {}, f"the checks could not run: {type(e).__name__}: {e}"
            cancelled = self.stop.is_set()
            for device in devices:
                report = reports.get(device)
                passed = report is not None and report.passed and not cancelled
                detail = ("cut short: the agent is closing" if cancelled
                          else summary(report) if report is not None else why)
                self.report("checked", device=device, stage=stage, passed=passed, cancelled=cancelled,
                            detail=detail[:4000])
        finally:
            with self._lock:
                for d in devices:
                    self._running.pop(d, None)


def _quiet(line: str) -> None:
    """Check progress stays on the node (the answer carries the verdict)."""
