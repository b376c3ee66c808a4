"""DCGM diagnostics: ``dcgmi diag -r LEVEL -i GPU`` where DCGM is installed.

Levels (DCGM docs): 1 = readiness (seconds), 2 = epilogue / after a failure (minutes), 3 and 4 =
post-mortem by an administrator (tens of minutes to hours). Quarantine defaults to level 2, the
level the reference table's rule 1 asks for before a reset GPU returns to service.

``dcgmi`` prints a table of ``| test | result |`` rows, the result starting with Pass, Fail, Warn
or Skip (e.g. ``Fail - GPU: 0``), followed by ``| Warning |`` / ``| Error |`` rows that explain a
failure; its exit status is non-zero when a test failed or the diagnostic could not run. The
device fails on any Fail row or a non-zero exit status; Warn rows are reported but pass. A
machine without ``dcgmi`` skips this check with "dcgmi not installed, skipped"; where it is
installed, a CPU device skips it because DCGM diagnoses NVIDIA GPUs only.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import time

from hotspare.errors import ConfigError
from hotspare.health.checks.result import CheckResult

LEVEL_TIMEOUT_S = {1: 300.0, 2: 1200.0, 3: 3600.0, 4: 4 * 3600.0}
_ROW = re.compile(r"^\s*\|\s*(?P<name>[^|]*?)\s*\|\s*(?P<result>[^|]*?)\s*\|\s*$")
_STATUSES = ("pass", "fail", "warn", "skip")


def parse_diag(text: str, returncode: int) -> tuple[bool, dict[str, list[str]]]:
    """``(passed, {"fail": [...], "warn": [...], "pass": [...], "skip": [...], "notes": [...]})``."""
    out: dict[str, list[str]] = {s: [] for s in _STATUSES}
    out["notes"] = []
    for line in text.splitlines():
        m = _ROW.match(line)
        if not m:
            continue
        name, result = m["name"], m["result"]
        status = result.split(" ", 1)[0].lower() if result else ""
        if status in _STATUSES and name:
            out[status].append(f"{name}: {result}")
        elif name.lower() in ("warning", "error", "info") and result:
            out["notes"].append(f"{name}: {result}")
        elif not name and result and out["notes"]:                 # a wrapped continuation line
            out["notes"][-1] += " " + result
    passed = returncode == 0 and not out["fail"]
    return passed, out


def dcgm_diag(device: str, gpu_index: int | None, *, level: int = 2, timeout_s: float | None = None,
              dcgmi: str | None = None) -> CheckResult:
    if level not in LEVEL_TIMEOUT_S:
        raise ConfigError(f"--dcgm-level {level!r}: DCGM diagnostic levels are 1, 2, 3 and 4")
    exe = dcgmi or shutil.which("dcgmi")
    if not exe:
        return CheckResult("dcgm-diag", device, True, "dcgmi not installed, skipped", skipped=True)
    if gpu_index is None:
        return CheckResult("dcgm-diag", device, True, "not a GPU: DCGM diagnoses NVIDIA GPUs only, skipped",
                           skipped=True)
    cmd = [exe, "diag", "-r", str(level), "-i", str(gpu_index)]
    timeout_s = timeout_s or LEVEL_TIMEOUT_S[level]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return CheckResult("dcgm-diag", device, False, f"{' '.join(cmd)} did not finish in {timeout_s:g} s",
                           {"command": cmd}, time.perf_counter() - t0)
    except OSError as e:
        return CheckResult("dcgm-diag", device, False, f"could not run {exe}: {e}", {"command": cmd},
                           time.perf_counter() - t0)
    passed, rows = parse_diag(p.stdout, p.returncode)
    m = {"command": cmd, "level": level, "returncode": p.returncode, **rows}
    elapsed = time.perf_counter() - t0
    if passed:
        warn = f"; {len(rows['warn'])} warning(s): " + "; ".join(rows["warn"]) if rows["warn"] else ""
        return CheckResult("dcgm-diag", device, True,
                           f"dcgmi diag -r {level}: {len(rows['pass'])} test(s) passed, "
                           f"{len(rows['skip'])} skipped{warn}", m, elapsed)
    if rows["fail"]:
        why = "; ".join(rows["fail"] + rows["notes"][:3])
    else:
        said = (p.stderr.strip() or p.stdout.strip()).splitlines()
        why = (f"exit status {p.returncode}: {said[-1] if said else 'no output'}"
               " (is nv-hostengine running? dcgmi diag needs it)")
    return CheckResult("dcgm-diag", device, False, f"dcgmi diag -r {level}: {why}", m, elapsed)
