"""The coordinator service for real, across 3 network namespaces: `hotspare coordinator` in the
hub, `hotspare agent` on each host, jobs from `hotspare submit`. The service is kill -9'd
mid-run and started again from its database (a rank is killed while it is away); two jobs run
side by side on their own hosts; a spare host joins a running job late and takes over a rank.
Every run ends bitwise equal to the same job on one host, losing and repeating no step.

Slow (CI runs -m slow)."""
import os
import signal

import pytest

from hotspare.testing import run_job
from hotspare.testing.local import EXAMPLE

pytestmark = pytest.mark.slow
STEPS = 400
ARGS = ["--model", "tiny", "--steps", str(STEPS)]


@pytest.fixture(scope="module")
def reference4():
    result = run_job(ARGS, nproc=4, spares=1)
    assert result.code == 0, result.output
    return result.digest


@pytest.fixture(scope="module")
def reference2():
    result = run_job(ARGS, nproc=2, spares=1)
    assert result.code == 0, result.output
    return result.digest


def assert_equal(row, report, reference, failures, log):
    assert row["state"] == "finished" and row["code"] == 0, log
    assert report["final_state_digest"] == reference, "the run diverged from the one-host run"
    assert report["replicas_consistent"] and report["steps_completed"] == STEPS
    assert report["steps_repeated"] == 0 and report["steps_lost"] == 0
    assert report["failures_total"] == failures and report["recovered_zero_loss"] == failures, \
        f"{report['failures']}\n{log}"


def test_coordinator_killed_and_restarted_mid_run_with_a_rank_lost_while_it_was_away(cluster, reference4):
    for host in ("hosta", "hostb"):
        cluster.start_agent(host)
    cluster.start_agent("hostc", spare=True)
    job = cluster.submit(2, 2, 1, str(EXAMPLE), ARGS, run_args=["--log-every", "10"])
    cluster.log.wait_for(rf"\[{job}\] step\s+100/", 120)
    cluster.kill_service()
    # The workers train on without it: each agent keeps what its workers say for the next service.
    for host in ("hosta", "hostb", "hostc"):
        cluster.agents[host].wait_for("the coordinator's link closed; training goes on", 10)
    victims = cluster.worker_pids("hostb", rank=3)
    assert len(victims) == 1
    os.kill(victims[0], signal.SIGKILL)          # a failure while nobody coordinates
    restarted = cluster.start_service()
    restarted.wait_for(rf"\[{job}\] resumed from the database at generation 1", 30)
    row, report = cluster.wait_job(job)
    log = restarted.text()
    assert_equal(row, report, reference4, 1, log)
    # the agents re-registered with the new service and replayed the steps trained meanwhile
    for host in ("hosta", "hostb", "hostc"):
        assert f"[{job}] NODE    {host}: resumed" in log
        assert "resuming job" in cluster.agents[host].text()
        # and its devices are watched again (no admission: they are at work)
        assert f"[{job}] HEALTH  node {host}: 2 device(s) watched" in log, log
    (failure,) = report["failures"]
    assert failure["rank"] == 3 and failure["kind"] == "SIGKILL" and failure["recovery_path"] == "memory"
    assert failure["replacement"] in {w["worker"] for w in report["nodes"]["hostc"]["workers"]}
    # after the job the hosts are back in the pool
    assert {h["name"]: h["state"] for h in cluster.status()["hosts"]} == {
        "hosta": "idle", "hostb": "idle", "hostc": "idle"}


def test_two_jobs_side_by_side_and_a_spare_host_that_joins_late(cluster, reference2):
    cluster.start_agent("hosta")
    cluster.start_agent("hostb")
    first = cluster.submit(1, 2, 0, str(EXAMPLE), ARGS)
    second = cluster.submit(1, 2, 1, str(EXAMPLE), ARGS, run_args=["--log-every", "10"])
    cluster.log.wait_for(rf"\[{second}\] placed: ranks on hostb, no spare host yet", 60)
    jobs = {j["id"]: j for j in cluster.status()["jobs"]}
    assert jobs[first]["placement"]["hosts"] == ["hosta"] and jobs[second]["placement"]["hosts"] == ["hostb"]
    cluster.log.wait_for(rf"\[{second}\] step\s+50/", 120)
    cluster.start_agent("hostc", spare=True)          # joins the running job short of its spare
    cluster.log.wait_for(rf"\[{second}\] spare host hostc joined", 30)
    cluster.log.wait_for(rf"\[{second}\] step\s+150/", 120)
    victims = cluster.worker_pids("hostb", rank=1)
    assert len(victims) == 1
    os.kill(victims[0], signal.SIGKILL)
    row1, report1 = cluster.wait_job(first)
    row2, report2 = cluster.wait_job(second)
    assert_equal(row1, report1, reference2, 0, cluster.log.text())
    assert_equal(row2, report2, reference2, 1, cluster.log.text())
    assert set(report1["nodes"]) == {"hosta"} and set(report2["nodes"]) == {"hostb", "hostc"}
    (failure,) = report2["failures"]
    assert failure["replacement"] in {w["worker"] for w in report2["nodes"]["hostc"]["workers"]}


def test_a_partitioned_host_fences_itself_while_the_service_fails_it_over(cluster, net, reference4):
    """Under the service, a link that closes is a service gone (the agent keeps training), but a
    host cut off gets no answer at all: its lease runs out and it fences, before the service
    declares it lost; after the heal nothing of it comes back."""
    for host in ("hosta", "hostb"):
        cluster.start_agent(host)
    cluster.start_agent("hostc", spare=True)
    job = cluster.submit(2, 2, 2, str(EXAMPLE), ARGS, run_args=["--log-every", "10", "--hang-floor", "30"])
    cluster.log.wait_for(rf"\[{job}\] step\s+100/", 120)
    healed = False
    try:
        net.cut("hostb")
        t_fence, _ = cluster.agents["hostb"].wait_for(r"FENCE   lease ran out", 15)
        assert cluster.agents["hostb"].proc.wait(timeout=15) == 3
        t_lost, _ = cluster.log.wait_for(r"NODE    hostb: no lease renewal for [\d.]+ s .*declared lost", 15)
        assert t_fence < t_lost
        assert net.pids(net["hostb"].ns) == []        # nothing of the old generation runs there
        net.heal("hostb")
        healed = True
        assert net.reachable("hostb")
        row, report = cluster.wait_job(job)
    finally:
        if not healed:
            net.heal("hostb")
    assert_equal(row, report, reference4, 2, cluster.log.text())
    assert report["nodes"]["hostb"]["lost"]
    assert {f["rank"] for f in report["failures"]} == {2, 3}
    assert all(f["kind"] == "node lost" for f in report["failures"])


def test_the_service_killed_in_the_middle_of_a_failover(cluster, reference4):
    """The service dies the moment it has seen a rank die: before, during or just after its
    decision (whichever this run hits). What it decided was written before any agent acted on
    it, what was in flight is said again by the agents, and orders are repeated: the failover
    completes once it is back, exactly once."""
    for host in ("hosta", "hostb"):
        cluster.start_agent(host)
    cluster.start_agent("hostc", spare=True)
    job = cluster.submit(2, 2, 1, str(EXAMPLE), ARGS, run_args=["--log-every", "10", "--hang-floor", "30"])
    cluster.log.wait_for(rf"\[{job}\] step\s+100/", 120)
    (victim,) = cluster.worker_pids("hostb", rank=2)
    os.kill(victim, signal.SIGKILL)
    cluster.log.wait_for(rf"\[{job}\] FAILED  rank 2", 30)
    cluster.kill_service()
    restarted = cluster.start_service()
    row, report = cluster.wait_job(job)
    assert_equal(row, report, reference4, 1, restarted.text())
    (failure,) = report["failures"]
    assert failure["rank"] == 2 and failure["recovery_path"] == "memory" and failure["lost_steps"] == 0
