"""A production job borrows a host of an *elastic* best-effort job, which shrinks instead of
pausing, for real, across network namespaces: `hotspare coordinator` in the hub, `hotspare agent`
per host, jobs from `hotspare submit`. The pool is full (no spare, no idle host): j1 (production,
2 ranks on hosta and hostb) and j2 (best-effort, --preemptible, --elastic 1, a script over
job.virtual_ranks, 2 ranks on hostc and hostd; hostd's agent runs in hostc's namespace).
hostb dies (SIGKILL to everything on it) -> j2 lends hostc by shrinking: hostc leaves it, its
agent ends j2's worker there, j2's virtual rank goes to its survivor on hostd (state of the
committed step from memory) and j2 keeps training; hostc takes j1's lost rank with its state
from rank 0's memory. j1 ends bitwise equal to its fault-free run, 0 steps lost. hostb's agent
comes back -> it is given to j2 as a spare host, j2 grows back there (Regrow at a step
boundary) and ends bitwise equal to its own fault-free elastic run (replicated state and every
virtual rank's generator and data position), every sample trained once per epoch, never
paused. (The released worker dies where its SIGKILL falls: its print of the step the shrink
resumed from may be cut after that step committed; that one line is allowed missing.) Both reports hold the one loan, which says the lender shrank.

Slow (CI runs -m slow): two reference runs and two jobs, a few minutes on 2 busy cores."""
import re
from pathlib import Path

import pytest

from hotspare.testing import run_job
from hotspare.testing.inproc import fault_free
from hotspare.testing.local import EXAMPLE
from hotspare.testing.servicejob import borrower_recovered
from hotspare.testing.elastic import trained, virtual_digests

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "elastic.py"
HIGH_STEPS, LOW_STEPS = 400, 480
HIGH = ["--model", "tiny", "--steps", str(HIGH_STEPS)]
SAMPLES, PER_EPOCH = 64, 8           # elastic.py: 2 virtual ranks x 8 batches of 4 per epoch


@pytest.fixture(scope="module")
def references():
    high = run_job(HIGH, nproc=2, spares=0)
    low = fault_free([str(LOW_STEPS), "0"], nproc=2, script=SCRIPT, extra=["--elastic", "1"])
    assert high.code == 0 and low.code == 0, high.output[-3000:] + low.output[-3000:]
    return high.digest, low


def test_an_elastic_best_effort_job_lends_its_host_by_shrinking_then_grows_back_bitwise(
        cluster, net, references, tmp_path):
    reference_high, ref_low = references
    for host, name in (("hosta", "hosta"), ("hostb", "hostb"), ("hostc", "hostc"), ("hostc", "hostd")):
        cluster.start_agent(host, devices=1, name=name)
    high = cluster.submit(2, 1, 0, str(EXAMPLE), HIGH, run_args=["--priority", "production", "--log-every", "10"])
    cluster.log.wait_for(rf"\[{high}\] placed: ranks on hosta, hostb", 60)
    low = cluster.submit(2, 1, 0, str(SCRIPT), [str(LOW_STEPS), "0.05"], run_args=[
        "--priority", "best-effort", "--preemptible", "--elastic", "1", "--checkpoint-dir", str(tmp_path / "ck"),
        "--log-every", "10"])
    cluster.log.wait_for(rf"\[{low}\] placed: ranks on hostc, hostd", 60)
    cluster.log.wait_for(rf"\[{low}\] step\s+20/", 120)
    cluster.log.wait_for(rf"\[{high}\] step\s+100/", 120)
    assert net.kill_all(net["hostb"].ns)                 # hostb dies: its agent and j1's rank 1
    cluster.log.wait_for(rf"\[{low}\] SHRINK  generation \d+: .*shrinking to 1 worker", 60)
    cluster.log.wait_for(rf"\[{high}\] RESUMED rank 1 -> {high}\.w\d+ on hostc", 120)
    cluster.start_agent("hostb", devices=1)             # the failed host returns: j2 grows back there
    cluster.log.wait_for(rf"\[{low}\] LOAN    hostb idle again: it runs shrunk, so it grows back there", 60)
    cluster.log.wait_for(rf"\[{low}\] REGROW  generation \d+: all ranks paused after step \d+", 180)

    row, report = cluster.wait_job(high)
    log = cluster.log.text()
    loan = borrower_recovered(row, report, log, reference_high, HIGH_STEPS, on="hostc")
    assert loan["kind"] == "device_loaned" and loan["data"]["lender_gives"] == "shrink"
    assert (loan["data"]["borrower"], loan["data"]["lender"], loan["data"]["hosts"]) == (high, low, ["hostc"])
    assert "it shrinks to 1 rank(s)" in loan["data"]["reason"]

    row, report = cluster.wait_job(low, timeout=300)
    log = cluster.log.text()
    assert row["state"] == "finished" and row["code"] == 0 and row["pauses"] == 0, log
    assert f"[{low}] PAUSE" not in log and report["pauses"] == []
    assert report["loans"] == [loan]                     # the one decision, in both reports
    assert report["final_state_digest"] == ref_low.digest, "the lender diverged from its fault-free elastic run"
    assert report["steps_completed"] == LOW_STEPS and report["steps_lost"] == 0 and report["steps_repeated"] == 0
    (shrunk,) = report["failures"]                       # its rank on hostc, released to lend the host
    assert shrunk["lost_steps"] == 0
    assert report["nodes"]["hostc"]["lost"] and "hostb" in report["nodes"]
    output = "\n".join(a.text() for a in cluster.agents.values())
    assert virtual_digests(output) == virtual_digests(ref_low.output) and len(virtual_digests(ref_low.output)) == 2
    samples = trained(ref_low.output)
    assert len(samples) == LOW_STEPS * 2
    # Every step trained the reference's samples. The one exception allowed: the released
    # worker's own line for the step the shrink resumed from, when its SIGKILL fell between that
    # step's commit and its print. That share was trained once all the same: the state of that
    # step is what the survivor took over, and every virtual rank's data position and generator
    # end bitwise equal to the reference's (asserted above).
    got = trained(output)
    shrink = re.search(rf"\[{low}\] SHRINK  generation \d+: .*virtual rank\(s\) (.*), same global batch; "
                       r"state of step (\d+) stays in memory", log)
    moved, resumed = {int(v) for v in re.findall(r"(\d+) -> ", shrink[1])}, int(shrink[2])
    wrong = sorted(k for k in set(got) | set(samples) if got.get(k) != samples.get(k))
    unsaid = [k for k in wrong if k not in got and k[0] == resumed and k[1] in moved]
    assert [k for k in wrong if k not in unsaid] == [] and len(unsaid) <= 1, (wrong[:10], resumed)
    for line in log.splitlines():       # the downtimes, for whoever reads the output (-s)
        if re.search(r"\] (RESUMED|SHRINK|REGROW|LEND|LOAN) ", line):
            print(line[:240])
    for epoch in range(LOW_STEPS // PER_EPOCH):
        seen = [i for (step, _), idx in samples.items() if step // PER_EPOCH == epoch for i in idx]
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}: a sample trained twice or not at all"
