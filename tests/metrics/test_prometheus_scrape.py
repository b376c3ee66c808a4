"""A real Prometheus scrapes a running `hotspare run --metrics` job in which rank 2 is SIGKILLed
at step 15: read back through Prometheus's HTTP API, the failure counter says one failure of
cause "killed" recovered from memory, and the downtime histogram holds exactly the downtime the
job's report measured."""
import json
import os
import socket
import subprocess
import sys
import time

from hotspare.testing.local import EXAMPLE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

# 70 steps of the tiny GPT: seconds of training after the recovery, many half-second scrapes.
ARGS = ["--model", "tiny", "--steps", "70"]


def test_prometheus_reads_the_failure_and_its_downtime_after_rank_killed(prometheus, tmp_path):
    port = free_port()
    prom = prometheus(f"127.0.0.1:{port}")
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "hotspare", "run", "--nproc", "4", "--spares", "1", "--report", str(report),
           "--metrics", f"127.0.0.1:{port}", "--inject", "kill:rank=2:step=15", "--", str(EXAMPLE), *ARGS]
    job = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = job.stdout + job.stderr
    assert job.returncode == 0, out
    assert f"metrics: http://127.0.0.1:{port}/metrics" in out
    r = json.loads(report.read_text())
    assert r["failures_total"] == 1 and r["recovered_zero_loss"] == 1, out
    downtime = r["failures"][0]["downtime_s"]

    # The job is over, so its series are stale now: read their newest sample within the window.
    def newest(metric: str) -> float | None:
        return prom.value(f"max_over_time({metric}[10m])")

    deadline = time.monotonic() + 10      # the last scrape may still be in flight
    while newest('hotspare_committed_step') != 69 and time.monotonic() < deadline:
        time.sleep(0.2)
    scraped = [t for t in prom.targets() if t["scrapeUrl"] == f"http://127.0.0.1:{port}/metrics"]
    assert scraped, prom.targets()
    assert newest('hotspare_committed_step') == 69, (prom.targets(), out)

    assert newest('hotspare_failures_total{kind="killed",path="memory"}') == 1
    assert prom.query('max_over_time(hotspare_failures_total{path!="memory"}[10m]) > 0') == []
    assert newest("hotspare_recovery_downtime_seconds_count") == 1
    assert abs(newest("hotspare_recovery_downtime_seconds_sum") - downtime) < 1e-6
    # the histogram's buckets place it: none below the downtime, the one above it holds it
    buckets = {float(s["metric"]["le"]): float(s["value"][1])
               for s in prom.query("max_over_time(hotspare_recovery_downtime_seconds_bucket[10m])")}
    assert buckets and all(n == (1.0 if le >= downtime else 0.0) for le, n in buckets.items()), (buckets, downtime)
    assert newest("hotspare_zero_loss_share_ratio") == 1.0
    assert newest("hotspare_lost_steps_total") == 0 and newest("hotspare_generation") == 2
