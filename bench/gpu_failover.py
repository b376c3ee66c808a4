"""The failover section of bench/gpu_check.py: whole `hotspare run` jobs on one GPU.

``check_failover(s, args, torch, dev)`` runs bench/gpu_failover_job.py under `hotspare run --nproc 4
--spares 1` three times (fault-free; rank 2 SIGKILLed with the spare's CUDA context warm; the same
cold) and judges them against each other; ``s`` is gpu_check.Section. On ``--device cpu`` (a dry
run of the harness, no GPU) the jobs run and the CUDA criteria fail, as they should.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAILOVER_STEPS, KILL_RANK, KILL_STEP, JOB_LIMIT_S = 40, 2, 20, 45
_now = time.perf_counter


# ---------------------------------------------------------------------------------- failover
def _job(dev, tmp: str, inject: str | None, warm: bool) -> dict:
    """One `hotspare run` of bench/gpu_failover_job.py; its exit code, report and rank stats."""
    stats, report = os.path.join(tmp, "stats"), os.path.join(tmp, "report.json")
    os.makedirs(stats)
    # One GPU is one device slot: --oversubscribe puts 5 processes on it, --telemetry off places them
    # without device slots (NVML is the 'nvml' section's).
    cmd = [sys.executable, "-m", "hotspare", "run", "--nproc", "4", "--spares", "1", "--oversubscribe",
           "--telemetry", "off", "--report", report, *(["--inject", inject] if inject else []), "--", str(REPO / "bench" / "gpu_failover_job.py"),
           "--device", str(dev), "--steps", str(FAILOVER_STEPS), "--stats", stats, *(["--warm"] if warm else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    limit = JOB_LIMIT_S if dev.type == "cuda" else 4 * JOB_LIMIT_S     # CPU: a dry run of the harness
    t0 = _now()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env, cwd=str(REPO))
    except subprocess.TimeoutExpired as e:     # the launcher is killed; its workers die with it
        tail = b"".join(x if isinstance(x, bytes) else (x or "").encode() for x in (e.stdout, e.stderr))
        raise RuntimeError(f"`hotspare run` did not finish in {limit} s; its output ended with:\n"
                           f"{tail[-3000:].decode('utf-8', 'replace')}") from None
    out = {"exit": proc.returncode, "seconds": round(_now() - t0, 2), "command": " ".join(cmd[2:])}
    rep = json.loads(Path(report).read_text()) if os.path.exists(report) else {}
    out["report"] = {k: rep.get(k) for k in ("outcome", "message", "steps_completed", "steps_repeated",
                                             "steps_lost", "failures_total", "recovered_zero_loss",
                                             "final_state_digest", "rank_digests", "wall_time_s")}
    out["failures"] = [{k: f.get(k) for k in ("rank", "cause", "recovery_path", "downtime_s", "phases_s")}
                       for f in rep.get("failures", [])]
    out["ranks"] = {p.stem: json.loads(p.read_text()) for p in sorted(Path(stats).glob("rank*.json"))}
    if proc.returncode != 0 or not rep:
        out["output_tail"] = (proc.stdout + proc.stderr)[-4000:]
    return out


def check_failover(s, args, torch, dev):
    """The model and optimizer on the GPU, 4 ranks + 1 spare sharing it over gloo."""
    s.measure(transport="gloo with CUDA tensors: the 4 ranks and the spare share one GPU, and NCCL "
                        "cannot put two ranks on one device (NCCL itself is checked in 'nccl')",
              job=f"bench/gpu_failover_job.py --steps {FAILOVER_STEPS} (MLP with dropout on the CUDA generator)",
              fault=f"kill:rank={KILL_RANK}:step={KILL_STEP}")
    runs: dict[str, dict] = {}
    kill = f"kill:rank={KILL_RANK}:step={KILL_STEP}"
    for name, inject, warm in (("fault_free", None, False), ("killed_warm_spare", kill, True),
                               ("killed_cold_spare", kill, False)):
        with s.step(name), tempfile.TemporaryDirectory(prefix=f"gpu_check.{name}.") as tmp:
            runs[name] = _job(dev, tmp, inject, warm)
        if name in runs:
            s.measure(**{name: runs[name]})
    free = runs.get("fault_free")
    if free is not None:
        rep = free["report"]
        s.expect(f"fault-free run: exit 0, {FAILOVER_STEPS} of {FAILOVER_STEPS} steps, no failure",
                 free["exit"] == 0 and rep["steps_completed"] == FAILOVER_STEPS and rep["failures_total"] == 0,
                 {"exit": free["exit"], "steps": rep["steps_completed"], "failures": rep["failures_total"]})
        devs = {r["param_device"] for r in free["ranks"].values()} | {
            r["optimizer_state_device"] for r in free["ranks"].values()}
        s.expect(f"parameters and optimizer state on {dev} on every rank",
                 len(free["ranks"]) == 4 and devs == {str(dev)}, sorted(devs))
        s.expect("the CUDA generator (rng/cuda) is in every rank's per-rank state",
                 free["ranks"] and all("rng/cuda" in r["rank_state_parts"] for r in free["ranks"].values()),
                 {k: r["rank_state_parts"] for k, r in free["ranks"].items()})
    for name in ("killed_warm_spare", "killed_cold_spare"):
        run = runs.get(name)
        if run is None:
            continue
        rep, fails = run["report"], run["failures"]
        s.expect(f"{name}: exit 0, one failure, recovered from memory, 0 steps lost or repeated",
                 run["exit"] == 0 and rep["failures_total"] == 1 and rep["recovered_zero_loss"] == 1
                 and not rep["steps_lost"] and not rep["steps_repeated"]
                 and rep["steps_completed"] == FAILOVER_STEPS,
                 {"exit": run["exit"], "failures": fails, "steps": rep["steps_completed"]})
        if free is not None:
            s.expect(f"{name}: final digest equal to the fault-free run's",
                     rep["final_state_digest"] is not None
                     and rep["final_state_digest"] == free["report"]["final_state_digest"],
                     [rep["final_state_digest"], free["report"]["final_state_digest"]])
            s.expect(f"{name}: every rank's per-rank digest (CUDA generator included) equal to the fault-free run's",
                     rep["rank_digests"] and rep["rank_digests"] == free["report"]["rank_digests"],
                     {"this": rep["rank_digests"], "fault_free": free["report"]["rank_digests"]})
        taker = run["ranks"].get(f"rank{KILL_RANK}", {})
        s.expect(f"{name}: rank {KILL_RANK} finished by the spare, with rng/cuda in its per-rank state",
                 taker.get("started_as") == "spare" and "rng/cuda" in taker.get("rank_state_parts", []),
                 {k: taker.get(k) for k in ("started_as", "rank_state_parts", "param_device")})
        if name == "killed_warm_spare":
            warmth = taker.get("warmth") or {}
            s.expect("killed_warm_spare: the spare's CUDA context was made before it took over (warm_cuda ran)",
                     bool(warmth) and not warmth.get("skipped") and warmth.get("total_s", 0) > 0, warmth)
    down = {n: runs[n]["failures"][0]["downtime_s"] for n in ("killed_warm_spare", "killed_cold_spare")
            if n in runs and runs[n]["failures"]}
    if len(down) == 2 and None not in down.values():
        s.measure(takeover_downtime_s=down, warm_saves_s=round(down["killed_cold_spare"] - down["killed_warm_spare"], 3))
