"""bench/gpu_check.py on a machine without a GPU: --help lists its sections, a run says "no CUDA",
exits 2 and writes why (never a pass by checking nothing). A GPU machine runs the rest."""
import json
import os
import subprocess
import sys
from pathlib import Path

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
