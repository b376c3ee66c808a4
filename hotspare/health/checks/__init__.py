"""Multi-stage device checks: admission (before a device takes work) and quarantine (deeper
diagnostics before a cordoned device returns to the pool). Continuous checking is the telemetry
poller's job (``hotspare.health.telemetry``).

    from hotspare.health.checks import run_admission, run_quarantine
    reports = run_admission(2, size="small")          # one DeviceReport per device
    all(r.passed for r in reports), [r.reasons for r in reports]

Every check yields a ``CheckResult`` (name, passed, detail, measurements, duration); a device's
results form a ``DeviceReport``; both serialize with ``to_dict()``. Torch is imported only inside
the functions that need it.
"""
from hotspare.health.checks.admission import run_admission
from hotspare.health.checks.quarantine import run_quarantine
from hotspare.health.checks.result import CheckResult, DeviceReport

__all__ = ["CheckResult", "DeviceReport", "run_admission", "run_quarantine"]
