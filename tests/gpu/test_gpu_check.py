"""bench/gpu_check.py, the one script that checks the GPU path on a real GPU: without CUDA it must
say so and exit 2 (never "pass" by checking nothing); a GPU machine runs the rest."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_without_cuda_it_says_no_cuda_exits_2_and_writes_why(tmp_path):
    out = tmp_path / "gpu.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}   # no GPU, even on a GPU machine
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--out", str(out)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no CUDA" in r.stdout
    data = json.loads(out.read_text())
    assert data["passed"] is False and "no CUDA" in data["no_cuda"] and "sections" not in data
