"""Quarantine diagnostics: deeper checks for a cordoned device before it returns to the pool.

Per device, one at a time, in a worker process of its own:

  inventory   the device's facts (recorded; there are no peers to compare with here)
  burn-in     the admission burn-in, longer: at least ``burn_seconds`` (``sizes.QUARANTINE``)
  memory      the pattern test over a larger buffer
  dcgm-diag   ``dcgmi diag -r LEVEL`` for GPUs where DCGM is installed (``dcgm.py``); otherwise
              skipped, saying why, while the checks above still run

A device passes when every check passes (skipped counts as passed). Quarantine runs on the node
that holds the device.
"""
from __future__ import annotations

import dataclasses
import os
import re
import threading
from collections.abc import Callable

from hotspare.errors import ConfigError
from hotspare.health.checks.admission import parse_injections
from hotspare.health.checks.dcgm import dcgm_diag
from hotspare.health.checks.result import CheckResult, DeviceReport
from hotspare.health.checks.runner import fill_missing, run_workers, say_to_stderr
from hotspare.health.checks.sizes import SIZE_NAMES, sizes_for
from hotspare.health.telemetry.base import default_node

CHECKS = ("inventory", "burn-in", "memory", "dcgm-diag")
_NAME = re.compile(r"^(?:(?P<node>[^/]+)/)?(?P<kind>cpu|gpu)(?P<index>\d+)$")


def parse_device(name: str, node: str | None = None) -> tuple[str, str, int]:
    """``"host/gpu3"`` or ``"gpu3"`` -> ``("host/gpu3", "gpu", 3)``, for a device on this node."""
    node = node or default_node()
    m = _NAME.match(name.strip())
    if not m:
        raise ConfigError(f"device {name!r}: name it NODE/KINDINDEX or KINDINDEX, e.g. {node}/gpu0 or cpu1")
    if m["node"] and m["node"] != node:
        raise ConfigError(f"device {name!r} is on node {m['node']!r}, but this is {node!r}: "
                          f"run quarantine diagnostics on the node that holds the device")
    kind, index = m["kind"], int(m["index"])
    if kind == "gpu":
        import torch
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if index >= gpus:
            raise ConfigError(f"device {name!r}: this node has {gpus} CUDA GPU(s)"
                              + (f" (gpu0..gpu{gpus - 1})" if gpus else ""))
    else:
        cores = os.cpu_count() or 1
        if index >= cores:
            raise ConfigError(f"device {name!r}: a CPU device is one core and this machine has {cores} (cpu0..cpu{cores - 1})")
    return f"{node}/{kind}{index}", kind, index


def run_quarantine(devices: list[str], *, size: str = "small", dcgm_level: int = 2,
                   burn_seconds: float | None = None, timeout_s: float | None = None,
                   dcgm_timeout_s: float | None = None, inject: list[str] | None = None,
                   node: str | None = None, progress: Callable[[str], None] = say_to_stderr) -> list[DeviceReport]:
    if not devices:
        raise ConfigError("name at least one device to diagnose, e.g. hotspare check quarantine gpu3")
    if size not in SIZE_NAMES:
        raise ConfigError(f"--size {size!r}: use one of {', '.join(SIZE_NAMES)}")
    if dcgm_level not in (1, 2, 3, 4):
        raise ConfigError(f"--dcgm-level {dcgm_level!r}: DCGM diagnostic levels are 1, 2, 3 and 4")
    if burn_seconds is not None and burn_seconds < 0:
        raise ConfigError(f"--burn-seconds {burn_seconds!r}: must be >= 0")
    parsed = [parse_device(d, node) for d in devices]
    if len({p[0] for p in parsed}) != len(parsed):
        raise ConfigError("a device is named twice; name each device once")
    injections = parse_injections(inject, [p[0] for p in parsed])
    return diagnose_devices(parsed, size=size, dcgm_level=dcgm_level, burn_seconds=burn_seconds,
                            timeout_s=timeout_s, dcgm_timeout_s=dcgm_timeout_s, inject=injections,
                            progress=progress)


def diagnose_devices(devices: list[tuple[str, str, int]], *, size: str = "small", dcgm_level: int = 2,
                     burn_seconds: float | None = None, timeout_s: float | None = None,
                     dcgm_timeout_s: float | None = None, inject: dict[str, set[str]] | None = None,
                     progress: Callable[[str], None] = say_to_stderr,
                     stop: threading.Event | None = None) -> list[DeviceReport]:
    """Quarantine diagnostics of ``devices`` (``(name, kind, index)`` on this node), one after
    the other, each in a check worker of its own; one report per device. ``stop`` cuts them
    short. The node agent's ``diagnose`` command runs this."""
    if size not in SIZE_NAMES:
        raise ConfigError(f"--size {size!r}: use one of {', '.join(SIZE_NAMES)}")
    injections = inject or {}
    reports = []
    for name, kind, index in devices:
        sizes = sizes_for("quarantine", kind, size)
        if burn_seconds is not None:
            sizes = dataclasses.replace(sizes, burn_seconds=burn_seconds)
        limit = timeout_s or (sizes.burn_seconds * 2 + (120.0 if size == "small" else 1800.0))
        progress(f"quarantine {name}: burn-in n={sizes.matmul_n} for >= {sizes.burn_seconds:g} s, "
                 f"memory {sizes.mem_bytes >> 20} MiB, dcgmi diag -r {dcgm_level}")
        [outcome] = run_workers([(name, kind, index)], stage="quarantine", sizes=sizes.__dict__,
                                timeout_s=limit, inject=injections, progress=progress, stop=stop)
        results = fill_missing(name, outcome.results, outcome.why_unfinished, ["burn-in", "memory"])
        if outcome.facts is not None:
            results.insert(0, CheckResult("inventory", name, True,
                                          ", ".join(f"{k} {outcome.facts[k]}" for k in
                                                    ("torch", "cpu_model", "gpu_name", "driver")
                                                    if k in outcome.facts), dict(outcome.facts)))
        elif not any(r.name == "inventory" for r in results):
            results.insert(0, CheckResult("inventory", name, False, "the worker reported no facts"))
        if stop is not None and stop.is_set():        # cut short: what ran is kept, nothing more runs
            reports.append(DeviceReport(name, "quarantine", results))
            break
        dcgm = dcgm_diag(name, index if kind == "gpu" else None, level=dcgm_level, timeout_s=dcgm_timeout_s)
        progress(f"[{name.rsplit('/', 1)[-1]}] {dcgm.line()}")
        results.append(dcgm)
        report = DeviceReport(name, "quarantine", results)
        progress(f"[{name.rsplit('/', 1)[-1]}] quarantine: {'PASS' if report.passed else 'FAIL'}"
                 + ("" if report.passed else " - " + "; ".join(report.reasons)))
        reports.append(report)
    return reports
