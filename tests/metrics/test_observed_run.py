"""One job watched three ways while rank 2 is SIGKILLed at step 15 and a warm spare takes it:

- a real Prometheus scrapes its `--metrics` endpoint; read back through Prometheus's HTTP API,
  the failure counter says one failure of cause "killed" recovered from memory, and the downtime
  histogram holds exactly the downtime the job's report measured;
- `hotspare events --follow`, started before the job, prints its failure, failover and recovery
  in that order and ends with the run;
- `hotspare report --plot` draws the run (loss curve and downtime by phase) into a PNG.
"""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from hotspare.coordinator.events import check_record
from hotspare.testing.local import EXAMPLE

HOTSPARE = [sys.executable, "-m", "hotspare"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
STEPS = 40      # the tiny GPT: 25 steps (a second or more) after the recovery, several half-second scrapes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def observed(prometheus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("observed")
    port = free_port()
    prom = prometheus(f"127.0.0.1:{port}")
    report = tmp / "run.json"
    follow = subprocess.Popen([*HOTSPARE, "events", "--follow", str(report), "--wait", "120"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        job = subprocess.run([*HOTSPARE, "run", "--nproc", "4", "--spares", "1", "--report", str(report),
                              "--metrics", f"127.0.0.1:{port}", "--inject", "kill:rank=2:step=15", "--",
                              str(EXAMPLE), "--model", "tiny", "--steps", str(STEPS)],
                             capture_output=True, text=True, timeout=240, env=ENV)
        followed, _ = follow.communicate(timeout=30)      # it ends by itself at the run's last record
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
    output = job.stdout + job.stderr
    assert job.returncode == 0, output
    assert f"metrics: http://127.0.0.1:{port}/metrics" in output
    r = json.loads(report.read_text())
    assert r["failures_total"] == 1 and r["recovered_zero_loss"] == 1, output
    return {"prom": prom, "port": port, "report": report, "r": r, "followed": followed,
            "follow_code": follow.returncode, "output": output, "tmp": tmp}


def test_prometheus_reads_the_failure_and_its_downtime_after_rank_killed(observed):
    prom, downtime = observed["prom"], observed["r"]["failures"][0]["downtime_s"]

    # The job is over, so its series are stale now: read their newest sample within the window.
    def newest(metric: str) -> float | None:
        return prom.value(f"max_over_time({metric}[10m])")

    deadline = time.monotonic() + 10      # the last scrape may still be in flight
    while newest("hotspare_recovery_downtime_seconds_count") is None and time.monotonic() < deadline:
        time.sleep(0.2)
    url = f"http://127.0.0.1:{observed['port']}/metrics"
    assert [t for t in prom.targets() if t["scrapeUrl"] == url], prom.targets()
    # scraped after the recovery (the run's last steps may end between two scrapes)
    assert newest("hotspare_committed_step") > 15, (prom.targets(), observed["output"])

    assert newest('hotspare_failures_total{kind="killed",path="memory"}') == 1
    assert prom.query('max_over_time(hotspare_failures_total{path!="memory"}[10m]) > 0') == []
    assert newest("hotspare_recovery_downtime_seconds_count") == 1
    assert abs(newest("hotspare_recovery_downtime_seconds_sum") - downtime) < 1e-6
    # the histogram's buckets place it: none below the downtime, every one from it up holds it
    buckets = {float(s["metric"]["le"]): float(s["value"][1])
               for s in prom.query("max_over_time(hotspare_recovery_downtime_seconds_bucket[10m])")}
    assert buckets and all(n == (1.0 if le >= downtime else 0.0) for le, n in buckets.items()), (buckets, downtime)
    assert newest("hotspare_zero_loss_share_ratio") == 1.0
    assert newest("hotspare_lost_steps_total") == 0 and newest("hotspare_generation") == 2


def test_events_follow_shows_failure_failover_recovery_and_ends_with_the_run(observed):
    out = observed["followed"]
    assert observed["follow_code"] == 0, out
    kinds = [line.split()[2] for line in out.splitlines()]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end", out
    assert [k for k in kinds if k in ("failure", "failover", "recovered")] == ["failure", "failover", "recovered"]
    assert "rank 2 (w2) SIGKILL at step 15" in out and "downtime" in out

    stream, r = observed["tmp"] / "run.events.jsonl", observed["r"]
    assert r["events_file"] == str(stream)
    records = [check_record(json.loads(line)) for line in stream.read_text().splitlines()]
    recovered = [rec for rec in records if rec["kind"] == "recovered"]
    assert len(recovered) == 1 and recovered[0]["data"]["downtime_s"] == r["failures"][0]["downtime_s"]
    dumped = subprocess.run([*HOTSPARE, "events", str(stream), "--json", "--kind", "recovered"],
                            capture_output=True, text=True, env=ENV)
    assert [json.loads(line) for line in dumped.stdout.splitlines()] == recovered


def test_report_plots_the_loss_curve_and_the_downtime_by_phase(observed):
    png = observed["tmp"] / "run.png"
    plot = subprocess.run([*HOTSPARE, "report", str(observed["report"]), "--plot", str(png)],
                          capture_output=True, text=True, env=ENV)
    assert plot.returncode == 0, plot.stdout + plot.stderr
    assert "#1 rank 2 SIGKILL at step 15: memory, lost 0" in plot.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_every_grafana_dashboard_query_is_promql_prometheus_accepts(observed):
    from test_metric_names import dashboard_queries
    for q in dashboard_queries():
        answer = observed["prom"].get("/api/v1/query", query=q)
        assert answer["status"] == "success", (q, answer)
    # the headline panels have data for the faulted run
    assert observed["prom"].value('sum(max_over_time(hotspare_failures_total{instance=~".*"}[1h]))') == 1
