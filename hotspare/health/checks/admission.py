"""Admission checks: run before a device takes work. Rule 32 of the reference table ("entry gate":
any failure keeps the device cordoned).

Per device, in a process of its own (see ``worker.py``):

  inventory   facts about the device and its software; must match the majority of its peers
  burn-in     float32 matmuls checked element by element against a float64 reference computed
              by numpy on the host (tolerance: see ``burnin.py``)
  throughput  the burn-in's best GFLOP/s; fails below ``(1 - margin)`` x the median of its peers
  memory      zeros / ones / walking ones and zeros / address patterns, read back exactly
  collective  all-reduce among the node's devices, results exact (see ``collective.py``)
  bandwidth   the all-reduce's median bus bandwidth; fails below ``(1 - margin)`` x its peers' median

CPU devices ("<node>/cpu<i>", one core each) run at small sizes, so all of this is exercised on
machines without GPUs; GPU devices ("<node>/gpu<i>", CUDA) get larger sizes (``sizes.py``).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable

from hotspare.errors import ConfigError
from hotspare.health.checks import inventory
from hotspare.health.checks.result import CheckResult, DeviceReport
from hotspare.health.checks.runner import fill_missing, run_workers, say_to_stderr
from hotspare.health.checks.sizes import SIZE_NAMES, sizes_for
from hotspare.health.telemetry.base import default_node

CHECKS = ("inventory", "burn-in", "throughput", "memory", "collective", "bandwidth")
DEFAULT_MARGIN = 0.2
INJECTABLE = ("burnin", "memory")     # --inject CHECK:DEVICE, for testing the checks themselves


def _cuda_gpus() -> int:
    """CUDA GPUs visible here. Without an NVIDIA driver the answer is 0 without importing torch
    (seconds on a busy machine), since the workers import it anyway."""
    import ctypes.util

    if not (os.path.exists("/dev/nvidiactl") or ctypes.util.find_library("nvidia-ml")
            or ctypes.util.find_library("cuda")):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_devices(n: int | None, kind: str = "auto", node: str | None = None) -> list[tuple[str, str, int]]:
    """``(name, kind, index)`` of the first ``n`` devices of ``kind`` here (auto: GPUs if any)."""
    node = node or default_node()
    if kind == "auto":
        kind = "gpu" if _cuda_gpus() else "cpu"
    gpus = _cuda_gpus() if kind == "gpu" else 0
    if kind == "gpu":
        if not gpus:
            raise ConfigError("no CUDA GPU is visible here; use --kind cpu (or check CUDA_VISIBLE_DEVICES)")
        n = gpus if n is None else n
        if not 1 <= n <= gpus:
            raise ConfigError(f"--devices {n}: this node has {gpus} GPU(s); use 1..{gpus}")
    elif kind == "cpu":
        cores = os.cpu_count() or 1
        n = min(2, cores) if n is None else n
        if not 1 <= n <= cores:
            raise ConfigError(f"--devices {n}: a CPU device is one core and this machine has {cores}; use 1..{cores}")
    else:
        raise ConfigError(f"device kind {kind!r} unknown; use cpu, gpu or auto")
    return [(f"{node}/{kind}{i}", kind, i) for i in range(n)]


def parse_injections(specs: list[str] | None, devices: list[str]) -> dict[str, set[str]]:
    """``["burnin:cpu1", "memory:host/cpu0"]`` -> ``{"host/cpu1": {"burnin"}, ...}``."""
    out: dict[str, set[str]] = {}
    by_short = {d.rsplit("/", 1)[-1]: d for d in devices}
    for spec in specs or ():
        check, _, dev = spec.partition(":")
        if check not in INJECTABLE or not dev:
            raise ConfigError(f"--inject {spec!r}: use CHECK:DEVICE with CHECK one of "
                              f"{', '.join(INJECTABLE)}, e.g. burnin:cpu1")
        full = dev if dev in devices else by_short.get(dev)
        if full is None:
            raise ConfigError(f"--inject {spec!r}: {dev!r} is not one of the devices checked here "
                              f"({', '.join(by_short)})")
        out.setdefault(full, set()).add(check)
    return out


def judge(outcomes, margin: float, stage: str = "admission",
          progress: Callable[[str], None] = lambda line: None) -> list[DeviceReport]:
    """Add the peer comparisons (inventory, throughput, bandwidth) to what the workers reported."""
    inv = inventory.compare({o.device: o.facts for o in outcomes if o.facts})
    gflops, busbw = {}, {}
    for o in outcomes:
        for r in o.results:
            if r.name == "burn-in" and r.passed:
                gflops[o.device] = r.measurements["gflops"]
            if r.name == "collective" and r.passed and not r.skipped:
                busbw[o.device] = r.measurements["busbw_gbps"]
    slow = inventory.slower_than_peers(gflops, margin, "matmul throughput", "GFLOP/s")
    narrow = inventory.slower_than_peers(busbw, margin, "all-reduce bus bandwidth", "GB/s")
    reports = []
    for o in outcomes:
        results = [r for r in o.results if r.name != "inventory"]
        if o.device in inv:
            results.insert(0, inv[o.device])
        elif o.facts is None and not any(r.name == "inventory" for r in o.results):
            results.insert(0, CheckResult("inventory", o.device, False, "the worker reported no facts"))
        else:
            results[:0] = [r for r in o.results if r.name == "inventory"]
        results.append(_peer_result("throughput", o.device, gflops, slow, "burn-in",
                                    "matmul throughput", "GFLOP/s", margin))
        results.append(_peer_result("bandwidth", o.device, busbw, narrow, "collective",
                                    "all-reduce bus bandwidth", "GB/s", margin,
                                    skipped=any(r.name == "collective" and r.skipped for r in o.results)))
        results = fill_missing(o.device, results, o.why_unfinished, list(CHECKS))
        results.sort(key=lambda r: CHECKS.index(r.name) if r.name in CHECKS else len(CHECKS))
        reports.append(DeviceReport(o.device, stage, results))
    for r in reports:
        for c in r.results:
            if c.name in ("inventory", "throughput", "bandwidth"):
                progress(f"[{r.device.rsplit('/', 1)[-1]}] {c.line()}")
    return reports


def _peer_result(name, dev, values, verdicts, source, what, unit, margin, skipped=False) -> CheckResult:
    if skipped:
        return CheckResult(name, dev, True, "only one device: no peers to compare with", skipped=True)
    if dev not in values:
        return CheckResult(name, dev, False, f"no {what} to compare: the {source} check did not pass")
    peers = {d: v for d, v in values.items() if d != dev}
    m = {"value": values[dev], "unit": unit, "margin": margin, "peers": peers}
    if not peers:
        return CheckResult(name, dev, True, f"{what} {values[dev]:.3g} {unit}; no peer result to compare with", m)
    if verdicts[dev]:
        return CheckResult(name, dev, False, verdicts[dev], m)
    import statistics
    med = statistics.median(peers.values())
    return CheckResult(name, dev, True, f"{what} {values[dev]:.3g} {unit}, {values[dev] / med:.0%} of its "
                       f"peers' median {med:.3g} {unit} (allowed down to {1 - margin:.0%})", m)


def run_admission(n_devices: int | None = None, *, size: str = "small", kind: str = "auto",
                  margin: float = DEFAULT_MARGIN, timeout_s: float | None = None,
                  inject: list[str] | None = None, node: str | None = None,
                  progress: Callable[[str], None] = say_to_stderr) -> list[DeviceReport]:
    """Admission checks of this node's first ``n_devices`` devices; one report per device."""
    if size not in SIZE_NAMES:
        raise ConfigError(f"--size {size!r}: use one of {', '.join(SIZE_NAMES)}")
    if not 0 <= margin < 1:
        raise ConfigError(f"--margin {margin!r}: a fraction in [0, 1), e.g. 0.2 for 20% below the peers' median")
    devices = local_devices(n_devices, kind, node)
    injections = parse_injections(inject, [d for d, _k, _i in devices])
    return admit_devices(devices, size=size, margin=margin, timeout_s=timeout_s, inject=injections,
                         progress=progress)


def admit_devices(devices: list[tuple[str, str, int]], *, size: str = "small", margin: float = DEFAULT_MARGIN,
                  timeout_s: float | None = None, inject: dict[str, set[str]] | None = None,
                  progress: Callable[[str], None] = say_to_stderr,
                  stop: threading.Event | None = None) -> list[DeviceReport]:
    """Admission checks of ``devices`` (``(name, kind, index)``, one kind, all on this node), in
    one device group of check workers; one report per device. ``stop`` cuts them short (the
    reports then fail what did not run). The node agent's ``admit`` command runs this."""
    if size not in SIZE_NAMES:
        raise ConfigError(f"--size {size!r}: use one of {', '.join(SIZE_NAMES)}")
    dkind = devices[0][1]
    sizes = sizes_for("admission", dkind, size)
    timeout_s = timeout_s or (120.0 if size == "small" else 1800.0) * (1 if dkind == "gpu" else max(1, len(devices) / 2))
    if timeout_s <= 0:
        raise ConfigError(f"--timeout {timeout_s!r}: must be > 0 seconds")
    progress(f"admission: {len(devices)} {dkind} device(s), size {size}: "
             f"matmul n={sizes.matmul_n} x{sizes.burn_reps}, memory {sizes.mem_bytes >> 20} MiB, "
             f"all-reduce {sizes.bw_bytes >> 20} MiB x{sizes.bw_iters}")
    outcomes = run_workers(devices, stage="admission", sizes=sizes.__dict__, timeout_s=timeout_s,
                           inject=inject or {}, progress=progress, stop=stop)
    reports = judge(outcomes, margin, progress=progress)
    for r in reports:
        progress(f"[{r.device.rsplit('/', 1)[-1]}] admission: {'PASS' if r.passed else 'FAIL'}"
                 + ("" if r.passed else " - " + "; ".join(r.reasons)))
    return reports
