"""Outcomes of health checks: one ``CheckResult`` per check, one ``DeviceReport`` per device.

Both are plain data and JSON-serializable (``to_dict`` / ``from_dict``), because checks run in
worker processes and their results travel as JSON lines to the process that judges them.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from hotspare.errors import HotspareError


class CheckCancelled(HotspareError):
    """A check was stopped part-way (its ``stop`` event was set): it has no verdict."""


def check_stop(stop, name: str) -> None:
    """Raise ``CheckCancelled`` if ``stop`` (a ``threading.Event`` or None) is set: long checks call
    it between their steps, each a fraction of a second, so whoever stops them waits no longer."""
    if stop is not None and stop.is_set():
        raise CheckCancelled(f"{name} cancelled")


@dataclasses.dataclass
class CheckResult:
    name: str                      # "burn-in", "memory", "collective", "inventory", "dcgm-diag", ...
    device: str                    # "<node>/<kind><index>"
    passed: bool
    detail: str                    # one human-readable line: what was measured, or what is wrong
    measurements: dict[str, Any] = dataclasses.field(default_factory=dict)
    duration_s: float = 0.0
    skipped: bool = False          # did not run (e.g. dcgmi not installed); counts as passed

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CheckResult:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    def line(self) -> str:
        verdict = "skip" if self.skipped else ("pass" if self.passed else "FAIL")
        return f"{self.name}: {verdict} - {self.detail} ({self.duration_s:.2f} s)"


@dataclasses.dataclass
class DeviceReport:
    device: str
    stage: str                     # "admission" or "quarantine"
    results: list[CheckResult]

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    @property
    def reasons(self) -> list[str]:
        """Why the device failed, one line per failed check; empty when it passed."""
        return [f"{r.name}: {r.detail}" for r in self.results if not r.passed]

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "stage": self.stage, "passed": self.passed,
                "reasons": self.reasons, "duration_s": round(sum(r.duration_s for r in self.results), 3),
                "results": [r.to_dict() for r in self.results]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceReport:
        return cls(d["device"], d["stage"], [CheckResult.from_dict(r) for r in d["results"]])


def run_check(name: str, device: str, fn: Callable[[], CheckResult]) -> CheckResult:
    """Run one check; an exception becomes a failed result that names it, never a crash."""
    t0 = time.perf_counter()
    try:
        r = fn()
    except Exception as e:  # noqa: BLE001 - a check that blows up has failed
        return CheckResult(name, device, False, f"raised {type(e).__name__}: {e}",
                           duration_s=time.perf_counter() - t0)
    if not r.duration_s:
        r.duration_s = time.perf_counter() - t0
    return r
