"""Inventory and driver consistency: what each device and its software stack report, and whether
peers agree.

Each device's worker collects facts about itself (:func:`collect`); the judge compares them across
the devices of the node, or across any peers whose facts it is given (:func:`compare`). A device
whose facts differ from the majority of its peers fails, with the differing keys named. Facts:

* every device: hotspare's Python and torch versions, CPU model, a digest of the CPU feature
  flags (so a node booted with different microcode or BIOS settings stands out), logical cores;
* GPU devices also: device name, total memory, compute capability, SM count, CUDA runtime
  version (torch), and the driver version and CUDA driver version from NVML when it loads.
"""
from __future__ import annotations

import collections
import hashlib
import os
import platform

from hotspare.health.checks.result import CheckResult

NOT_COMPARED = {"device"}     # differs by construction


def _cpuinfo() -> tuple[str, list[str]]:
    model, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "cpu model") and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = sorted(value.split())
                if model and flags and key == "":
                    break
    except OSError:
        pass
    return model, flags


def _nvml_versions() -> dict[str, str]:
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVML is optional; torch still reports the rest
        return {}
    out = {}
    try:
        v = pynvml.nvmlSystemGetDriverVersion()
        out["driver"] = v.decode() if isinstance(v, bytes) else str(v)
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        out["cuda_driver"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
    except Exception:  # noqa: BLE001
        pass
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    return out


def collect(device: str, torch_device: str = "cpu") -> dict[str, object]:
    """Facts about this device and the software that drives it."""
    import torch

    model, flags = _cpuinfo()
    facts: dict[str, object] = {
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_model": model,
        "cpu_flags_sha1": hashlib.sha1(" ".join(flags).encode()).hexdigest()[:12] if flags else "unknown",
        "cpu_flags_count": len(flags),
        "logical_cores": os.cpu_count(),
    }
    dev = torch.device(torch_device)
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        facts.update({"gpu_name": p.name, "gpu_memory_bytes": int(p.total_memory),
                      "compute_capability": f"{p.major}.{p.minor}", "sm_count": int(p.multi_processor_count),
                      "cuda_runtime": torch.version.cuda or "none"})
        facts.update(_nvml_versions())
    return facts


def compare(facts: dict[str, dict[str, object]]) -> dict[str, CheckResult]:
    """One inventory result per device.

    For each fact the value most devices report is taken as right; a device with another value
    fails. When no value has more devices than every other (two devices that disagree), nobody
    can tell which is odd, so every device that disagrees with another fails.
    """
    out = {}
    keys = sorted({k for f in facts.values() for k in f} - NOT_COMPARED)
    for dev, mine in facts.items():
        peers = {d: f for d, f in facts.items() if d != dev}
        summary = {k: mine.get(k) for k in ("torch", "cpu_model", "gpu_name", "driver") if k in mine}
        if not peers:
            out[dev] = CheckResult("inventory", dev, True, f"{_fmt(summary)}; no peers to compare with", dict(mine))
            continue
        diffs = []
        for k in keys:
            counts = collections.Counter(repr(f.get(k)) for f in facts.values())
            (common, n), *rest = counts.most_common()
            unique_majority = not rest or rest[0][1] < n
            if repr(mine.get(k)) != common or not unique_majority:
                theirs = ", ".join(f"{d.rsplit('/', 1)[-1]}={f.get(k)!r}" for d, f in peers.items()
                                   if repr(f.get(k)) != repr(mine.get(k)))
                if theirs:
                    diffs.append(f"{k}={mine.get(k)!r} but {theirs}")
        if diffs:
            out[dev] = CheckResult("inventory", dev, False, "differs from peers: " + "; ".join(diffs), dict(mine))
        else:
            out[dev] = CheckResult("inventory", dev, True,
                                   f"{_fmt(summary)}; agrees with the majority of the {len(facts)} devices on all {len(keys)} facts", dict(mine))
    return out


def _fmt(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


def slower_than_peers(values: dict[str, float], margin: float, what: str, unit: str) -> dict[str, str | None]:
    """Per device: None if ``values[d]`` is within ``margin`` of its peers' median, else why not.

    ``margin`` 0.2 flags a device below 80% of the median of the *other* devices' values.
    """
    import statistics

    out: dict[str, str | None] = {}
    for d, v in values.items():
        peers = [values[p] for p in values if p != d]
        if not peers:
            out[d] = None
            continue
        med = statistics.median(peers)
        if v < med * (1 - margin):
            out[d] = (f"{what} {v:.3g} {unit} is {1 - v / med:.0%} below the median of its "
                      f"{len(peers)} peer(s), {med:.3g} {unit} (allowed: {margin:.0%})")
        else:
            out[d] = None
    return out
