"""bench/gpu_check.py on a machine without a GPU: --help lists its sections, a run says "no CUDA",
exits 2 and writes why (never a pass by checking nothing). A GPU machine runs the rest."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
ENV = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1]), "OMP_NUM_THREADS": "1"}


def test_help_lists_every_section_and_the_output_option():
    r = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                       timeout=60, env=ENV)
    assert r.returncode == 0, r.stderr
    for word in ("--out", "--device", "--budget-s", "failover", "nccl", "nccl_forming", "snapshot", "broadcast",
                 "warm_spare", "nvml", "burn_in", "no CUDA"):
        assert word in r.stdout


def test_without_cuda_it_says_no_cuda_exits_2_and_writes_only_why(tmp_path):
    out = tmp_path / "gpu.json"
    env = {**ENV, "CUDA_VISIBLE_DEVICES": ""}          # no GPU visible, even on a GPU machine
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no CUDA" in r.stderr and "NVIDIA GPU" in r.stderr
    data = json.loads(out.read_text())
    assert data["passed"] is False and "no CUDA" in data["no_cuda"] and "sections" not in data


def _gpu_check():
    import importlib
    sys.path[:0] = [str(SCRIPT.parent)]
    try:
        return importlib.import_module("gpu_check")
    finally:
        del sys.path[0]


def test_a_section_that_outlives_its_limit_is_killed_and_says_in_which_step(tmp_path):
    """Each section is time-bounded in a process of its own: here the burn-in on CPU (a dry run of
    the harness; its fp32 n=4096 step alone takes longer) cannot finish in 3 s; it is killed, and
    the result names the step it was in."""
    g = _gpu_check()
    args = g.parse(["--device", "cpu", "--burn-n", "64", "--burn-reps", "2"])
    r = g._child("burn_in", args, 3.0, str(tmp_path))
    assert not r["passed"] and r["seconds"] < 30
    steps = ("set-up (import torch, bind the device)", "section", "bf16 n=64", "fp32 admission n=4096")
    assert any(p in [f"timed out after 3 s in step {s!r}" for s in steps] for p in r["problems"]), r["problems"]
    assert r["what"].startswith("bf16 burn-in")


@pytest.mark.slow
def test_the_failover_section_runs_its_three_jobs_on_cpu_and_only_the_cuda_criteria_fail(tmp_path):
    """A dry run of the failover section without a GPU (~2 min): the `hotspare run` command lines,
    the report and per-rank stats it reads and the judging all work, so the GPU run spends its
    minutes on the GPU. Everything but the CUDA criteria holds on CPU."""
    g = _gpu_check()
    args = g.parse(["--device", "cpu"])
    r = g._child("failover", args, 600.0, str(tmp_path))
    failed = sorted(c for c, v in r["criteria"].items() if not v["ok"])
    assert failed == sorted([
        "the CUDA generator (rng/cuda) is in every rank's per-rank state",
        "killed_warm_spare: rank 2 finished by the spare, with rng/cuda in its per-rank state",
        "killed_warm_spare: the spare's CUDA context was made before it took over (warm_cuda ran)",
        "killed_cold_spare: rank 2 finished by the spare, with rng/cuda in its per-rank state"]), r
    assert len(r["criteria"]) == 12 and not r["errors"]
    assert set(r["measured"]["takeover_downtime_s"]) == {"killed_warm_spare", "killed_cold_spare"}
