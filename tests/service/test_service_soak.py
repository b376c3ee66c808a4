"""A soak of the coordinator service: 20 jobs on two hosts, submitted and cancelled in a random
(seeded) order while others run to completion. Every job ends as its operator asked (a job
cancelled ends cancelled, whether it was queued or running then; every other one finishes),
and no host is left stuck: both are idle at the end, with no worker of any job left on them.

Slow (CI runs -m slow)."""
import random
import time

import pytest

from svcloop import workers_of

pytestmark = pytest.mark.slow
SEED = 29
JOBS = 20
CANCELLED = 8


def wait_running(loopback, job: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while loopback.row(job)["state"] == "queued":
        assert time.time() < deadline, f"{job} still queued after {timeout:.0f} s:\n{loopback.log.text()}"
        time.sleep(0.3)


def test_twenty_jobs_submitted_cancelled_and_completed_in_a_seeded_order_end_as_asked(loopback, tmp_path):
    rng = random.Random(SEED)
    for host in ("hosta", "hostb"):
        loopback.start_agent(host, devices=1)
    to_cancel = set(rng.sample(range(JOBS), CANCELLED))
    # the operator's script: every job submitted, some cancelled later, in a shuffled order
    ops = [("submit", i) for i in range(JOBS)]
    for i in sorted(to_cancel):
        at = ops.index(("submit", i)) + 1
        ops.insert(rng.randint(at, len(ops)), ("cancel", i))
    ids: dict[int, str] = {}
    cancelled: set[int] = set()
    for op, i in ops:
        if op == "submit":
            # a job to be cancelled would train for hours; the others finish in a few steps
            steps = 100000 if i in to_cancel else 3
            ids[i] = loopback.submit(steps=steps, per_node=1,
                                     run_args=["--checkpoint-dir", str(tmp_path / f"ck{i}")])
        else:
            # Some cancels wait for their job to run first: only where it will run, i.e. fewer long
            # jobs ahead of it in the queue are left uncancelled than there are hosts.
            ahead = [j for j in to_cancel - cancelled if j < i]
            if len(ahead) < 2 and rng.random() < 0.5:
                wait_running(loopback, ids[i])
            reply = loopback.request("cancel", job=ids[i])
            assert reply["ok"], reply
            cancelled.add(i)
        time.sleep(rng.uniform(0.0, 1.5))                 # the service goes on meanwhile
    asked = {ids[i]: ("cancelled" if i in to_cancel else "finished") for i in range(JOBS)}
    ended = {job: loopback.wait_ended(job, timeout=600)["state"] for job in asked}
    assert ended == asked, loopback.log.text()
    loopback.wait_hosts({"hosta": "idle", "hostb": "idle"}, timeout=60)
    for host, agent in loopback.agents.items():
        assert agent.proc.poll() is None, agent.text()
        assert all(workers_of(job, agent) == [] for job in asked), host
    log = loopback.log.text()
    assert "failed in the coordinator" not in log and "Traceback" not in log
    # the cancels met jobs in both states (the seed and the pauses make it so)
    assert "CANCEL  by" in log and "before it was placed" in str(loopback.request("status")["jobs"])
    assert "did not say released" not in log            # every host came back on its agent's word
