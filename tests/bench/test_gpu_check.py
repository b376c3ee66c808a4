"""bench/gpu_check.py on a machine without a GPU: --help works, a run says why it cannot (exit 2)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
ENV = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}


def test_help_lists_every_section_and_the_output_option():
    r = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                       timeout=60, env=ENV)
    assert r.returncode == 0, r.stderr
    for word in ("--out", "--device", "nccl", "snapshot", "broadcast", "warm_spare", "nvml", "burn_in"):
        assert word in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: the check would run")
def test_without_a_gpu_it_exits_2_with_a_clear_message_and_writes_nothing(tmp_path):
    out = tmp_path / "gpu.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True,
                       text=True, timeout=120, env=ENV)
    assert r.returncode == 2
    assert "no CUDA GPU here" in r.stderr and "NVIDIA GPU" in r.stderr
    assert not out.exists()
