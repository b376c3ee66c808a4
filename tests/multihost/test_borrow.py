"""A production job borrows a device of a best-effort job, for real, across 3 network
namespaces: `hotspare coordinator` in the hub, `hotspare agent` on each host, jobs from
`hotspare submit`. The pool is full (no spare host, no idle host): j1 (production, 2 ranks on
hosta and hostb) and j2 (best-effort, --preemptible, 1 rank on hostc). hostb dies (SIGKILL to
everything on it, agent and worker) -> j2 is paused (a signed checkpoint), hostc takes j1's lost
rank with its state from rank 0's memory; j1 ends bitwise equal to its fault-free run, 0 steps
lost. hostb's agent comes back -> j2 resumes there from its checkpoint and ends bitwise equal to
its own fault-free run, every step done once. Both reports hold the one loan.

Slow (CI runs -m slow): two reference runs and two jobs, about 2 minutes on 2 busy cores."""
import pytest

from hotspare.testing import run_job
from hotspare.testing.local import EXAMPLE
from hotspare.testing.servicejob import borrower_recovered

pytestmark = pytest.mark.slow
HIGH_STEPS, LOW_STEPS = 400, 1200
HIGH = ["--model", "tiny", "--steps", str(HIGH_STEPS)]
LOW = ["--model", "tiny", "--steps", str(LOW_STEPS)]


@pytest.fixture(scope="module")
def references():
    two, one = run_job(HIGH, nproc=2, spares=0), run_job(LOW, nproc=1, spares=0)
    assert two.code == 0 and one.code == 0, two.output + one.output
    return two.digest, one.digest


def test_a_production_job_borrows_the_best_effort_jobs_host_which_pauses_and_resumes_bitwise(
        cluster, net, references, tmp_path):
    reference_high, reference_low = references
    for host in ("hosta", "hostb", "hostc"):
        cluster.start_agent(host, devices=1)
    high = cluster.submit(2, 1, 0, str(EXAMPLE), HIGH, run_args=["--priority", "production", "--log-every", "10"])
    cluster.log.wait_for(rf"\[{high}\] placed: ranks on hosta, hostb", 60)
    low = cluster.submit(1, 1, 0, str(EXAMPLE), LOW, run_args=[
        "--priority", "best-effort", "--preemptible", "--checkpoint-dir", str(tmp_path / "ck"), "--log-every", "10"])
    cluster.log.wait_for(rf"\[{low}\] placed: ranks on hostc", 60)
    cluster.log.wait_for(rf"\[{low}\] step\s+100/", 120)
    cluster.log.wait_for(rf"\[{high}\] step\s+100/", 120)
    assert net.kill_all(net["hostb"].ns)                 # hostb dies: its agent and j1's rank 1
    cluster.log.wait_for(rf"\[{low}\] PAUSED  paused to lend hostc to {high}; resumes from .*step-0+(\d+)", 60)
    cluster.log.wait_for(rf"\[{high}\] RESUMED rank 1 -> {high}\.w\d+ on hostc", 120)
    cluster.start_agent("hostb", devices=1)             # the failed host returns: capacity for j2
    cluster.log.wait_for(rf"\[{low}\] placed: ranks on hostb", 120)

    row, report = cluster.wait_job(high)
    log = cluster.log.text()
    loan = borrower_recovered(row, report, log, reference_high, HIGH_STEPS, on="hostc")
    assert loan["kind"] == "device_loaned"
    assert (loan["data"]["borrower"], loan["data"]["lender"], loan["data"]["hosts"]) == (high, low, ["hostc"])
    assert loan["data"]["borrower_priority"] > loan["data"]["lender_priority"]

    row, report = cluster.wait_job(low, timeout=300)
    assert row["state"] == "finished" and row["code"] == 0 and row["pauses"] == 1, log
    assert report["final_state_digest"] == reference_low, "the lender diverged from its fault-free run"
    assert report["steps_completed"] == LOW_STEPS and report["steps_lost"] == 0
    (pause,) = report["pauses"]
    assert pause["loan"] == loan                         # the one decision, in both reports
    assert pause["lost_steps"] == 0 and pause["checkpoint_step"] == pause["committed_step"] >= 100
    assert report["job"]["resume"].endswith(f"step-{pause['checkpoint_step']:09d}")
    assert set(report["nodes"]) == {"hostb"}



def test_never_from_an_equal_priority_job_the_borrower_waits_until_the_failed_host_returns(
        cluster, net, references, tmp_path):
    """The same full pool, but j2 is production too (and preemptible): nobody may lend. j1 waits
    for a device (it is said why); j2 is never touched. A new agent starts on hostb, named hostd
    (a host j1 lost comes back to it only under a new name): idle in the pool, it is lent to j1
    at once, whose rank 1 resumes from rank 0's memory. Both end bitwise equal to their
    fault-free runs."""
    reference_high, reference_low = references
    for host in ("hosta", "hostb", "hostc"):
        cluster.start_agent(host, devices=1)
    high = cluster.submit(2, 1, 0, str(EXAMPLE), HIGH, run_args=["--priority", "production", "--log-every", "10"])
    cluster.log.wait_for(rf"\[{high}\] placed: ranks on hosta, hostb", 60)
    other = cluster.submit(1, 1, 0, str(EXAMPLE), LOW, run_args=[
        "--priority", "production", "--preemptible", "--checkpoint-dir", str(tmp_path / "ck"), "--log-every", "10"])
    cluster.log.wait_for(rf"\[{other}\] step\s+100/", 120)
    cluster.log.wait_for(rf"\[{high}\] step\s+100/", 120)
    assert net.kill_all(net["hostb"].ns)
    cluster.log.wait_for(rf"\[{high}\] LOAN    waiting: .*{other} \(production\) is not of lower priority", 60)
    cluster.start_agent("hostb", devices=1, name="hostd")
    cluster.log.wait_for(rf"\[{high}\] LOAN    .*idle host\(s\) hostd of the pool take the lost rank", 60)
    row, report = cluster.wait_job(high)
    log = cluster.log.text()
    assert row["state"] == "finished" and report["final_state_digest"] == reference_high, log
    assert report["steps_lost"] == 0 and [f["recovery_path"] for f in report["failures"]] == ["memory"]
    (loan,) = report["loans"]
    assert (loan["data"]["lender"], loan["data"]["hosts"]) == ("", ["hostd"])
    assert f"[{high}] NODE    refused" not in log
    row, report = cluster.wait_job(other, timeout=300)
    assert row["state"] == "finished" and row["pauses"] == 0 and f"[{other}] PAUSE" not in log, log
    assert report["final_state_digest"] == reference_low and report["loans"] == [] and report["pauses"] == []
