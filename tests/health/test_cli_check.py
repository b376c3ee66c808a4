"""`hotspare check` as users run it: a real subprocess, real worker processes, real exit codes."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def hotspare(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "hotspare", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


def test_help_teaches_each_stage():
    p = hotspare("check", "admission", "--help")
    assert p.returncode == 0
    for word in ("--devices", "--size", "--json", "burn-in", "float64 reference", "exit status: 0 all"):
        assert word in p.stdout
    q = hotspare("check", "quarantine", "--help")
    assert q.returncode == 0 and "dcgmi not installed, skipped" in q.stdout and "--dcgm-level" in q.stdout
    assert hotspare("check").returncode == 2


def test_bad_input_exits_2_and_says_what_to_fix():
    p = hotspare("check", "admission", "--devices", "0")
    assert p.returncode == 2 and "check at least 1 device" in p.stderr
    p = hotspare("check", "quarantine", "elsewhere/gpu0")
    assert p.returncode == 2 and "run quarantine diagnostics on the node that holds the device" in p.stderr
    p = hotspare("check", "quarantine", "disk0")
    assert p.returncode == 2 and "NODE/KINDINDEX" in p.stderr
    p = hotspare("check", "admission", "--size", "huge")
    assert p.returncode == 2 and "invalid choice" in p.stderr


def test_admission_with_a_flipped_memory_bit_fails_that_device_only():
    p = hotspare("check", "admission", "--devices", "2", "--kind", "cpu", "--margin", "0.5",
                 "--inject", "memory:cpu1", "--json")
    assert p.returncode == 1, p.stdout + p.stderr
    out = json.loads(p.stdout)
    cpu0, cpu1 = out["devices"]
    assert not out["passed"] and cpu0["passed"], (cpu0["reasons"], p.stderr)
    assert not cpu1["passed"] and len(cpu1["reasons"]) == 1
    assert cpu1["reasons"][0].startswith("memory: 6 wrong word(s)")
    assert "[cpu0] burn-in: pass" in p.stderr and "[cpu1] admission: FAIL" in p.stderr   # progress


def test_quarantine_of_a_cpu_device_passes_and_says_dcgm_was_skipped():
    p = hotspare("check", "quarantine", "cpu0", "--burn-seconds", "0.3")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "(quarantine)" in p.stdout and ": PASS" in p.stdout
    for name in ("inventory: pass", "burn-in: pass", "memory: pass", "dcgm-diag: skip"):
        assert name in p.stdout
    if shutil.which("dcgmi") is None:
        assert "dcgmi not installed, skipped" in p.stdout
