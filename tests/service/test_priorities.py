"""Priorities and preemption policy of the service's jobs, without workers: the classes and
their integers, a bad class or a preemptible job without a checkpoint directory refused at
submit with what to do, the queue placed highest priority first, `hotspare status` showing
them; a database written before priorities migrated in place (its copy kept), one of a newer
schema refused; what a paused job keeps and how it is queued again."""
import argparse
import json
import sqlite3
import subprocess
import sys

import pytest

from hotspare.cli.jobs import request
from hotspare.policy.phase import JobPhase
from hotspare.policy.signals import Checkpointed
from hotspare.policy.view import ClusterView
from hotspare.protocol import auth
from hotspare.service import db as states
from hotspare.service.db import StateDB
from hotspare.service.dbcheck import PRE_MIGRATION_SUFFIX, VERSION, StateDBError
from hotspare.service.pause import pause_record, resume_request, short_of
from hotspare.service.priority import CLASSES, DEFAULT_CLASS, JobPolicy, parse_priority, queue_order
from hotspare.service.service import Service
from hotspare.testing.local import EXAMPLE

REQUEST = {"script": "/x/train.py", "args": [], "nodes": 1, "nproc_per_node": 2, "spares": 0, "run_args": []}


@pytest.fixture
def service(tmp_path, secret_file):
    lines = []
    svc = Service("127.0.0.1", 0, auth.load_secret(secret_file), secret_file, str(tmp_path / "state"),
                  log=lines.append)
    yield svc, argparse.Namespace(coordinator=svc.address, secret_file=secret_file)
    svc.stop()


def job(tmp_path, **over):
    return {"script": str(EXAMPLE), "args": ["--steps", "3"], "nodes": 1, "nproc_per_node": 2, "spares": 0,
            "run_args": ["--checkpoint-dir", str(tmp_path / "ck")], **over}


def test_classes_are_integers_and_a_bad_class_says_which_exist():
    assert parse_priority("production") > parse_priority("research") > parse_priority("best-effort")
    assert parse_priority("Best-Effort") == CLASSES["best-effort"] == 0 and parse_priority("250") == 250
    assert JobPolicy().priority == CLASSES[DEFAULT_CLASS]
    for bad in ("urgent", "1e3", str(10**10)):
        with pytest.raises(ValueError, match="production=1000"):
            parse_priority(bad)


def test_submit_stores_the_policy_and_status_shows_it(service, tmp_path):
    svc, c = service
    request(c, "submit", **job(tmp_path, priority="best-effort", preemptible=True, elastic=1))
    request(c, "submit", **job(tmp_path))                      # an older client sends none of them
    low, plain = request(c, "status")["jobs"]
    assert (low["priority"], low["priority_class"], low["preemptible"], low["elastic"]) == (0, "best-effort", True, 1)
    assert (plain["priority_class"], plain["preemptible"], plain["elastic"]) == (DEFAULT_CLASS, False, None)
    shown = subprocess.run([sys.executable, "-m", "hotspare", "status", "--coordinator", svc.address,
                            "--secret-file", c.secret_file], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "best-effort,preemptible,elastic>=1" in shown.stdout, shown.stdout


@pytest.mark.parametrize("over, says", [
    ({"priority": "urgent"}, "give a class"),
    ({"preemptible": True, "run_args": []}, "--preemptible needs --checkpoint-dir"),
    ({"elastic": 3}, "--elastic 3: give the fewest ranks"),
    ({"preemptible": "yes"}, "'preemptible' must be true or false"),
])
def test_a_bad_policy_is_refused_at_submit_with_what_to_do(service, tmp_path, over, says):
    svc, c = service
    with pytest.raises(LookupError, match=says):
        request(c, "submit", **job(tmp_path, **over))
    assert request(c, "status")["jobs"] == []


def test_the_client_refuses_preemptible_without_a_checkpoint_dir_before_sending(secret_file):
    done = subprocess.run([sys.executable, "-m", "hotspare", "submit", "--coordinator", "127.0.0.1:9",
                           "--secret-file", secret_file, "--preemptible", "--", str(EXAMPLE)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--preemptible needs --checkpoint-dir" in done.stderr, done.stderr


def test_the_queue_is_placed_highest_priority_first_then_by_submission(tmp_path):
    db = StateDB(tmp_path)
    for job, prio in (("j1", 0), ("j2", 1000), ("j3", 100), ("j4", 1000)):
        db.submit(job, REQUEST, JobPolicy(prio))
    assert [r.id for r in queue_order(db.jobs((states.QUEUED,)))] == ["j2", "j4", "j3", "j1"]


def test_a_database_from_before_priorities_is_migrated_and_its_copy_kept(tmp_path):
    path = tmp_path / "coordinator.db"
    old = sqlite3.connect(path)             # version 1's schema, as an older service left it
    old.executescript("""
        CREATE TABLE hosts (name TEXT PRIMARY KEY, devices TEXT NOT NULL, spare INTEGER NOT NULL,
                            state TEXT NOT NULL, seen REAL NOT NULL);
        CREATE TABLE jobs (id TEXT PRIMARY KEY, request TEXT NOT NULL, state TEXT NOT NULL, submitted REAL NOT NULL,
                           started REAL, ended REAL, message TEXT NOT NULL DEFAULT '', placement TEXT, store TEXT,
                           code INTEGER, report TEXT);
        CREATE TABLE job_state (job TEXT PRIMARY KEY, state TEXT NOT NULL, saved REAL NOT NULL);
        CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, t REAL NOT NULL, job TEXT, what TEXT NOT NULL);""")
    old.execute("INSERT INTO jobs (id, request, state, submitted) VALUES ('j1', ?, 'queued', 1.0)", (json.dumps(REQUEST),))
    old.commit()
    old.close()
    db = StateDB(tmp_path)
    (row,) = db.jobs()
    assert row.id == "j1" and row.policy == JobPolicy() and row.pauses == ()
    db.close()
    kept = sqlite3.connect(path.with_name(path.name + PRE_MIGRATION_SUFFIX))
    assert "priority" not in {r[1] for r in kept.execute("PRAGMA table_info(jobs)")}
    kept.close()
    again = sqlite3.connect(path)
    assert again.execute("PRAGMA user_version").fetchone()[0] == VERSION
    again.execute(f"PRAGMA user_version = {VERSION + 1}")
    again.commit()
    again.close()
    with pytest.raises(StateDBError, match="newer hotspare"):
        StateDB(tmp_path)


def test_a_bad_pauses_row_is_refused_at_start(tmp_path):
    StateDB(tmp_path).submit("j1", REQUEST)
    db = sqlite3.connect(tmp_path / "coordinator.db")
    db.execute("UPDATE jobs SET pauses='{\"not\": \"a list\"}'")
    db.commit()
    db.close()
    with pytest.raises(StateDBError, match="its pauses is not what the service wrote"):
        StateDB(tmp_path)


def test_a_paused_job_is_queued_again_to_resume_from_its_checkpoint_and_keeps_each_pause(tmp_path):
    db = StateDB(tmp_path)
    request = {**REQUEST, "run_args": ["--checkpoint-dir", "/ck", "--resume", "/old/step-1"]}
    db.submit("j2", request, JobPolicy(0, True))
    assert not db.requeue("j2", request, {}, "not running")           # only a running job is paused
    db.start_if_queued("j2", {"hosts": ["c"], "spare_hosts": []}, {"host": "h", "port": 1})
    again = resume_request(request, "/ck/step-000000104")
    assert again["run_args"] == ["--checkpoint-dir", "/ck", "--resume", "/ck/step-000000104"]
    assert resume_request(request, None) == request                    # no checkpoint: as it started before
    pause = pause_record({"kind": "device_loaned"}, {"steps_completed": 105, "outcome": "preempted"},
                         Checkpointed(104, "/ck/step-000000104"), 10.0, 10.5)
    assert (pause["lost_steps"], pause["checkpoint_step"], pause["pause_s"]) == (0, 104, 0.5)
    assert db.requeue("j2", again, pause, "paused to lend c to j1")
    (row,) = db.jobs()
    assert row.state == states.QUEUED and row.request == again and row.pauses == (pause,) and row.placement is None
    late = pause_record({}, {"steps_completed": 105}, Checkpointed(100, "/ck/step-100"), 0.0, 1.0)
    assert late["lost_steps"] == 4 and pause_record({}, {"steps_completed": 0}, None, 0, 1)["lost_steps"] == 0


def test_a_job_is_short_of_devices_only_for_lost_ranks_it_cannot_place():
    view = ClusterView(world_size=2, target_spares=1)
    assert short_of(view, 1) == 0                     # starting, short of its spare only
    view.phase, view.lost = JobPhase.RECOVERING, {1}
    assert short_of(view, 1) == 1 and short_of(view, 3) == 1 and short_of(view, 0) == 0
    view.stopping = "no capacity"
    assert short_of(view, 1) == 0
