"""Jobs of the coordinator service on loopback, with real agents and workers: a host serves job
after job; a cancel is kept (a job cancelled while queued, or while its rendezvous store
starts, never reaches an agent; one cancelled while running stops after a last checkpoint).
Each runs real jobs, 25-50 s on 2 busy cores: slow (CI runs -m slow); the pure host lifecycle,
the run_args and database checks and the agent's link are tested in the default suite."""
import os
import re

import pytest

import hotspare.service.service as service_module
from hotspare.checkpoint import load_key, newest_valid

from svcloop import workers_of


@pytest.mark.slow
def test_a_job_cancelled_while_its_store_starts_never_starts_and_its_host_takes_the_next(loopback, monkeypatch):
    """The race of the bug: placement had read the queue and was starting the job's store when
    the cancel came, then overwrote it. Now the commit re-checks the job under the lock."""
    agent = loopback.start_agent("hosta")
    real, stores = service_module.start_store, []

    def cancelled_meanwhile(host):
        store = real(host)              # the store is up; the operator's cancel lands before the commit
        stores.append(store)
        if len(stores) == 1:
            assert loopback.request("cancel", job="j1")["message"] == "job j1 cancelled"
        return store

    monkeypatch.setattr(service_module, "start_store", cancelled_meanwhile)
    first = loopback.submit()
    loopback.log.wait_for(r"\[j1\] not started: it was cancelled while its rendezvous store started", 60)
    row = loopback.row(first)
    assert row["state"] == "cancelled" and row["placement"] is None, row
    with pytest.raises(ProcessLookupError):
        os.kill(stores[0]["pid"], 0)                  # its store was stopped
    second = loopback.submit()
    row = loopback.wait_ended(second)
    assert row["state"] == "finished" and row["placement"]["hosts"] == ["hosta"], loopback.log.text()
    assert f"job {second}:" in agent.text()
    assert "job j1" not in agent.text() and workers_of("j1", agent) == []    # never reached the agent
    loopback.wait_hosts({"hosta": "idle"})


@pytest.mark.slow
def test_three_jobs_one_after_another_on_one_host_each_finish(loopback):
    loopback.start_agent("hosta")
    for _ in range(3):
        job = loopback.submit()
        row = loopback.wait_ended(job)
        assert row["state"] == "finished" and row["code"] == 0, loopback.log.text()
        assert row["placement"]["hosts"] == ["hosta"]
        loopback.wait_hosts({"hosta": "idle"})
    assert "KeyError" not in loopback.log.text()


@pytest.mark.slow
def test_cancelled_while_queued_never_starts_and_cancelled_while_running_stops_with_a_last_checkpoint(
        loopback, tmp_path):
    agent = loopback.start_agent("hosta")
    checkpoints = tmp_path / "ck"
    running = loopback.submit(steps=100000, run_args=["--checkpoint-dir", str(checkpoints), "--log-every", "1"])
    loopback.log.wait_for(rf"\[{running}\] step\s+\d+/", 120)
    queued = loopback.submit()                       # the only host is busy: it waits
    assert loopback.row(queued)["state"] == "queued"
    assert loopback.request("cancel", job=queued)["ok"]
    seen = int(loopback.log.wait_for(rf"\[{running}\] step\s+(\d+)/", 30).group(1))
    assert loopback.request("cancel", job=running)["ok"]
    row = loopback.wait_ended(running, timeout=60)
    assert row["state"] == "cancelled" and row["message"].startswith("cancelled by "), row
    last, refused = newest_valid(str(checkpoints), load_key())   # signed, complete, not older than seen
    assert last is not None and not refused, (refused, loopback.log.text())
    assert last.step >= seen, (last.step, seen)
    assert re.search(rf"\[{running}\] STOPPING .*last checkpoint", loopback.log.text())
    loopback.wait_hosts({"hosta": "idle"})
    # the queued job was never placed, never reached the agent, and stays cancelled with its host free
    assert loopback.row(queued)["state"] == "cancelled"
    assert f"[{queued}] placed" not in loopback.log.text()
    assert f"job {queued}" not in agent.text() and workers_of(queued, agent) == []


@pytest.mark.slow
def test_a_job_cancelled_as_soon_as_it_is_placed_stops_with_no_worker_left_and_its_host_takes_the_next(
        loopback, tmp_path):
    """The cancel lands while the job's coordinator still starts its ranks: it is kept until they
    are started, then the job stops (no rank holds state yet to checkpoint)."""
    agent = loopback.start_agent("hosta")
    job = loopback.submit(steps=100000, run_args=["--checkpoint-dir", str(tmp_path / "ck")])
    while loopback.row(job)["state"] == "queued":
        pass
    assert loopback.request("cancel", job=job)["ok"]
    row = loopback.wait_ended(job, timeout=60)
    assert row["state"] == "cancelled" and row["message"].startswith("cancelled by "), row
    loopback.wait_hosts({"hosta": "idle"})
    assert workers_of(job, agent) == []
    following = loopback.submit()
    assert loopback.wait_ended(following)["state"] == "finished", loopback.log.text()
