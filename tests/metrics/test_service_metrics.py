"""The coordinator service's /metrics: two jobs' coordinators (real ones, with their ledgers),
one with rank 2 killed and replaced from memory; every series carries its job_name, the killed
rank counts for its job only, and a finished job reads as not running."""
import queue

import pytest

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hotspare.coordinator import Coordinator, Ledger
from hotspare.coordinator import events as ev
from hotspare.coordinator.nodes import Nodes
from hotspare.observe.service import ServiceMetrics
from hotspare.policy.actions import FormGeneration
from hotspare.policy.phase import JobPhase
from hotspare.policy.view import ClusterView

T = 1796300000.0


def coordinator(job: str) -> Coordinator:
    return Coordinator(Nodes(job=job), queue.Queue(), ClusterView(world_size=4, target_spares=1),
                       Ledger({"script": "train.py", "nproc": 4}), log=lambda line: None)


def samples(registry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(generate_latest(registry).decode()) for s in fam.samples}


def test_each_jobs_series_carry_its_job_name_and_a_kill_counts_for_its_job_only():
    service = ServiceMetrics()
    a, b = coordinator("job-a"), coordinator("job-b")
    service.install("job-a", a, a.ledger)
    service.install("job-b", b, b.ledger)
    L = a.ledger
    for r in range(4):
        L.commit(r, 0, 0.05, 1, 4, T)
    L.member_lost(2, "job-a-w2", -9, T + 1, last_step=1, error=None, node_lost=False, spare_was_warm=True)
    L.formed(FormGeneration(2, {0: "w0", 1: "w1", 2: "w4", 3: "w3"}, 0, 0, (2,), {2: "w4"}), "warm spare", T + 1.1)
    a.view.generation = 2
    for r in range(4):
        L.commit(r, 1, 0.05, 2, 4, T + 1.4)
    a.handle(ev.AgentRefused("n0", "spawn", "no such device", T + 2))   # any event: the observer looks after it
    s = samples(service.registry)
    assert s[("hotspare_failures_total", (("job_name", "job-a"), ("kind", "killed"), ("path", "memory")))] == 1
    assert not any(name == "hotspare_failures_total" and ("job_name", "job-b") in labels for name, labels in s)
    assert s[("hotspare_recovery_downtime_seconds_count", (("job_name", "job-a"), ("path", "memory")))] == 1
    assert s[("hotspare_generation", (("job_name", "job-b"),))] == 0
    assert s[("hotspare_run_running", (("job_name", "job-a"),))] == 1
    b.view.phase = JobPhase.FINISHED
    assert samples(service.registry)[("hotspare_run_running", (("job_name", "job-b"),))] == 0


@pytest.mark.slow
def test_the_service_exposes_a_submitted_jobs_killed_rank_under_its_job_name(tmp_path):
    """`hotspare coordinator --metrics` on loopback with one agent: a job submitted with rank 1
    killed at step 10 shows in /metrics as one failure of that job, recovered from memory."""
    import os
    import re
    import secrets
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    from hotspare.testing.local import EXAMPLE

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    port, mport = free_port(), free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    hs = [sys.executable, "-m", "hotspare"]
    procs = []

    def start(args, log):
        procs.append(subprocess.Popen([*hs, *args], stdout=open(tmp_path / log, "w"), stderr=subprocess.STDOUT,
                                      env=env, start_new_session=True))

    def wait_log(log, pattern, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if re.search(pattern, (tmp_path / log).read_text()):
                return
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} in {log}:\n{(tmp_path / log).read_text()[-3000:]}")
    try:
        start(["coordinator", "--listen", f"127.0.0.1:{port}", "--state", str(tmp_path / "state"), "--secret-file",
               str(secret), "--metrics", f"127.0.0.1:{mport}", "--allow-inject"], "service.log")
        wait_log("service.log", rf"metrics: http://127.0.0.1:{mport}/metrics", 60)
        start(["agent", "--coordinator", f"127.0.0.1:{port}", "--secret-file", str(secret), "--devices", "cpu:3",
               "--name", "hosta", "--allow-inject"], "agent.log")
        wait_log("service.log", r"NODE    hosta: registered", 60)
        done = subprocess.run([*hs, "submit", "--coordinator", f"127.0.0.1:{port}", "--secret-file", str(secret),
                               "--nodes", "1", "--nproc-per-node", "2", "--spares", "1", "--inject",
                               "kill:rank=1:step=10", "--wait", "--", str(EXAMPLE), "--model", "tiny", "--steps", "40"],
                              capture_output=True, text=True, env=env, timeout=240)
        assert done.returncode == 0 and "j1 finished" in done.stdout, done.stdout + done.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as r:
            text = r.read().decode()
        s = {(x.name, tuple(sorted(x.labels.items()))): x.value
             for fam in text_string_to_metric_families(text) for x in fam.samples}
        assert s[("hotspare_failures_total", (("job_name", "j1"), ("kind", "killed"), ("path", "memory")))] == 1
        assert s[("hotspare_recovery_downtime_seconds_count", (("job_name", "j1"), ("path", "memory")))] == 1
        assert s[("hotspare_committed_step", (("job_name", "j1"),))] == 39
        assert s[("hotspare_run_running", (("job_name", "j1"),))] == 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
