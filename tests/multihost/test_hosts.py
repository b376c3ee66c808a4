"""Many hosts, for real: 3 network namespaces (2 worker hosts holding ranks 0-1 and 2-3, one
spare host with 2 spares), a launcher in the hub, `hotspare agent` on each host. A whole host
killed, or cut off and healed, must end bitwise equal to a fault-free run on one host, losing
and repeating no step, with nothing of the old generation left on the cut-off host.

About 60 s together on 2 cores, in the default suite: the node-loss core of many hosts. The
service, refusal and remote-health tests beside it are slow (CI runs -m slow)."""
import re
import signal

import pytest

from hotspare.agent.remote import EXIT_FENCED
from hotspare.testing import run_job
from hotspare.testing.hostjob import HostJob

STEPS = 400
ARGS = ["--model", "tiny", "--steps", str(STEPS)]
LEASE = ["--node-lease", "2", "--lease-margin", "1"]


@pytest.fixture(scope="module")
def reference():
    """The same job on one host, over loopback, without faults."""
    result = run_job(ARGS, nproc=4, spares=2)
    assert result.code == 0, result.output
    return result.digest


def assert_equal_to_reference(code, report, job, reference, failures):
    assert code == 0, job.log.text()
    assert report["final_state_digest"] == reference, "the multi-host run diverged from the one-host run"
    assert report["replicas_consistent"] and report["steps_completed"] == STEPS
    assert report["steps_repeated"] == 0 and report["steps_lost"] == 0
    assert report["failures_total"] == failures and report["recovered_zero_loss"] == failures, job.log.text()


def workers_of(report, node):
    return {w["worker"] for w in report["nodes"][node]["workers"]}


@pytest.mark.slow   # run by .ci/run after the default suite (the default suite's budget: README)
def test_three_hosts_without_faults_equal_one_host(net, secret_file, reference, tmp_path):
    job = HostJob(net, secret_file, str(tmp_path / "r.json"), ARGS, extra=LEASE)
    try:
        code, report = job.finish()
    finally:
        job.stop()
    assert_equal_to_reference(code, report, job, reference, 0)
    assert {n: len(v["workers"]) for n, v in report["nodes"].items()} == {"hosta": 2, "hostb": 2, "hostc": 2}
    assert all(log.proc.returncode == 0 for log in job.agent_logs.values())


@pytest.mark.slow   # run by .ci/run after the default suite (the default suite's budget: README)
def test_host_killed_mid_run_fails_over_to_the_spare_host(net, secret_file, reference, tmp_path):
    job = HostJob(net, secret_file, str(tmp_path / "r.json"), ARGS, extra=[*LEASE, "--log-every", "10"])
    try:
        job.log.wait_for(r"step\s+100/", 120)
        killed = net.kill_all(net["hostb"].ns, signal.SIGKILL)      # its agent, zygote and workers
        assert len(killed) >= 3
        code, report = job.finish()
    finally:
        job.stop()
    assert_equal_to_reference(code, report, job, reference, 2)
    assert report["nodes"]["hostb"]["lost"] and not report["nodes"]["hosta"]["lost"]
    lost = {f["worker"] for f in report["failures"]}
    assert lost <= workers_of(report, "hostb") and {f["rank"] for f in report["failures"]} == {2, 3}
    assert all(f["kind"] == "node lost" and f["lost_steps"] == 0 for f in report["failures"])
    # the replacements are the spares of the spare host
    assert {f["replacement"] for f in report["failures"]} <= workers_of(report, "hostc")
    assert "NODE    hostb: the link to its agent closed; 2 worker(s) lost with it" in job.log.text()


@pytest.mark.slow   # run by .ci/run after the default suite (the default suite's budget: README)
def test_partitioned_host_fences_itself_and_stays_out_after_healing(net, secret_file, reference, tmp_path):
    # A hang floor above lease + margin: the partition is found by the lease, not by the hang detector.
    job = HostJob(net, secret_file, str(tmp_path / "r.json"), ARGS,
                  extra=[*LEASE, "--log-every", "10", "--hang-floor", "30"], env={"HOTSPARE_DEBUG": "1"})
    healed = False
    try:
        job.log.wait_for(r"step\s+100/", 120)
        net.cut("hostb")
        job.agent_logs["hostb"].wait_for(r"FENCE   lease of 2 s ran out", 15)
        assert job.agents["hostb"].wait(timeout=15) == EXIT_FENCED
        t_lost, _ = job.log.wait_for(r"NODE    hostb: no lease renewal for [\d.]+ s .*declared lost", 15)
        # Before the link heals, nothing of the old generation runs on the cut-off host.
        assert net.pids(net["hostb"].ns) == []
        net.heal("hostb")
        healed = True
        assert net.reachable("hostb"), "the healed link does not carry traffic"
        # A stale agent that comes back under its old name is refused: it must join as a new node.
        stale = job.start_agent("hostb", "hostb")
        assert stale.wait(timeout=30) == 2
        assert "was declared lost" in job.agent_logs["hostb"].text()
        code, report = job.finish()
    finally:
        if not healed:
            net.heal("hostb")
        job.stop()
    assert_equal_to_reference(code, report, job, reference, 2)
    assert report["nodes"]["hostb"]["lost"]
    assert all(f["kind"] == "node lost" for f in report["failures"]) and {f["rank"] for f in report["failures"]} == {2, 3}
    # Nothing from the old workers reached the coordinator after the loss (commits, done, exits...).
    old = workers_of(report, "hostb")
    def spoke(lines):
        return [line for line in lines if (m := re.search(r"debug   event \w+\(worker='(w\d+)'", line)) and m[1] in old]
    assert spoke(line for t, line in job.log.lines if t < t_lost), "the debug log does not show their messages"
    assert spoke(line for t, line in job.log.lines if t > t_lost) == []
