"""Run ``hotspare run`` as a real subprocess and collect its report."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "gpt_stdlib.py"
# The ordinary DDP scripts of examples/ (not the GPT), as the tests and bench/kill_runs.py run
# them: script -> (its arguments, the steps it runs).
ORDINARY_SCRIPTS = {
    "cnn_loader": (["--epochs", "2"], 16),              # 2 epochs of 8 steps: boundaries at 7/8
    "mlp_accum": (["--steps", "24"], 24),
    "amp_text": (["--steps", "24"], 24),
    "buffers_dropout": (["--steps", "24"], 24),
}


@dataclass
class JobResult:
    code: int
    output: str
    report: dict[str, Any] | None

    @property
    def digest(self) -> str | None:
        return self.report and self.report.get("final_state_digest")


def run_job(script_args: list[str], nproc: int = 4, spares: int = 1, inject: list[str] = (),
            script: str | Path = EXAMPLE, extra: list[str] = (), timeout: float = 300,
            env: dict[str, str] | None = None, stream: bool = False) -> JobResult:
    """Run a job; ``stream=True`` lets its output through to the terminal instead of capturing it."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "hotspare", "run", "--nproc", str(nproc), "--spares", str(spares),
               "--report", report, *extra]
        for spec in inject:
            cmd += ["--inject", spec]
        cmd += ["--", str(script), *script_args]
        proc = subprocess.run(cmd, capture_output=not stream, text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        data = json.load(open(report)) if os.path.exists(report) else None
        return JobResult(proc.returncode, "" if stream else proc.stdout + proc.stderr, data)


def run_torchrun(script_args: list[str], script: str | Path, nproc: int = 4, timeout: float = 300,
                 stats_flag: str | None = "--stats") -> tuple[subprocess.CompletedProcess, list[dict[str, Any]]]:
    """Run ``script`` under plain ``torchrun`` (no hotspare launcher) with ``--stats PREFIX``
    (unless ``stats_flag`` is None); returns the process and each rank's stats file
    (``PREFIX.rank<R>.json``) in rank order."""
    import socket
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))      # torchrun's --master-port 0 does not reach the workers
        port = sock.getsockname()[1]
        sock.close()
        prefix = os.path.join(tmp, "stats")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                               "--master-port", str(port), str(script), *script_args,
                               *([stats_flag, prefix] if stats_flag else [])],
                              capture_output=True, text=True, timeout=timeout, env=env)
        stats = [json.load(open(f"{prefix}.rank{r}.json")) for r in range(nproc)
                 if os.path.exists(f"{prefix}.rank{r}.json")]
        return proc, stats
