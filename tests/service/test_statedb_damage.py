"""Damaged state stops the service at start: a truncated database, one bad JSON row, a 0-byte
file, a lost file. `hotspare coordinator` then says which file, what is wrong and how to restore
the backup it keeps; never a traceback, never a start with no jobs. Following what it says
brings the jobs back."""
import json
import os
import sqlite3
import subprocess
import sys

import pytest

from hotspare.service import db as states
from hotspare.service.db import StateDB
from hotspare.service.dbcheck import StateDBError, backup_path

REQUEST = {"script": "/x/train.py", "args": ["--steps", "3"], "nodes": 1, "nproc_per_node": 2, "spares": 0,
           "run_args": []}


@pytest.fixture
def state(tmp_path):
    """A service's state: two jobs queued, one of them running with its state saved."""
    db = StateDB(tmp_path / "state")
    for _ in range(2):
        db.submit(db.next_job_id(), REQUEST)
    assert db.start_if_queued("j1", {"hosts": ["a"], "spare_hosts": []}, {"host": "127.0.0.1", "port": 1, "pid": 1})
    db.save_state("j1", {"format": 1, "view": {"generation": 1, "pad": "x" * 20000}})
    db.event("placed", "j1")
    db.close()
    from hotspare.health.registry import Registry
    registry = Registry(tmp_path / "state" / "coordinator.db")
    registry.ensure("a/cpu0")                  # the service's device registry too
    registry.store.close()
    db = StateDB(tmp_path / "state")       # the backup holds it
    db.close()
    return tmp_path / "state"


def start(state_dir, secret_file) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hotspare", "coordinator", "--listen", "127.0.0.1:0", "--state",
                           str(state_dir), "--secret-file", secret_file], capture_output=True, text=True, timeout=60)


def truncated(path):
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def bad_json_row(path):
    db = sqlite3.connect(path)
    db.execute("UPDATE jobs SET request=? WHERE id='j2'", ('{"script": "/x/train.py", "nodes": ',))
    db.commit()
    db.close()


def bad_health_row(path):
    db = sqlite3.connect(path)
    db.execute("INSERT OR REPLACE INTO health_registry (id, doc) VALUES (1, ?)", ('{"format": "hotspare-health-re',))
    db.commit()
    db.close()


def empty(path):
    path.write_bytes(b"")


def garbage(path):
    with open(path, "r+b") as f:
        f.seek(4096)
        f.write(os.urandom(8192))


@pytest.mark.parametrize("damage, what", [
    (truncated, "is damaged"),
    (bad_json_row, "holds a bad row: jobs 'j2', its request"),
    (bad_health_row, "holds a bad row: health_registry"),
    (empty, "is empty (0 bytes)"),
    (garbage, "is damaged"),
])
def test_a_damaged_database_stops_the_service_at_start_naming_the_file_and_the_backup(
        state, secret_file, damage, what):
    path = state / "coordinator.db"
    damage(path)
    size = path.stat().st_size
    done = start(state, secret_file)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "coordinator service on" not in done.stdout
    assert f"the coordinator service's database {path} {what}" in done.stderr, done.stderr
    assert f"Restore the backup the service keeps ({backup_path(path)}, made " in done.stderr
    assert "2 job(s)" in done.stderr                          # what the backup holds
    assert path.stat().st_size == size                        # left as it was found, for the operator
    # what it says to do brings the state back
    restore = next(line for line in done.stderr.splitlines() if line.startswith("  mv "))
    subprocess.run(restore, shell=True, check=True)
    db = StateDB(state)
    try:
        assert [(j.id, j.state) for j in db.jobs()] == [("j1", states.RUNNING), ("j2", states.QUEUED)]
        assert db.load_state("j1")["view"]["generation"] == 1
    finally:
        db.close()


def test_a_lost_database_with_its_backup_beside_it_is_not_a_fresh_start(state):
    (state / "coordinator.db").unlink()
    with pytest.raises(StateDBError, match="is missing, but a backup of it is there.*Restore the backup"):
        StateDB(state)


def test_without_a_usable_backup_it_says_how_to_start_with_no_state(state):
    backup_path(state / "coordinator.db").write_bytes(b"")
    empty(state / "coordinator.db")
    with pytest.raises(StateDBError) as e:
        StateDB(state)
    assert "No usable backup to restore" in str(e.value) and "is empty (0 bytes)" in str(e.value)
    assert "to start with no state" in str(e.value)


def test_the_backup_follows_each_change_of_a_jobs_state(tmp_path):
    db = StateDB(tmp_path)
    db.submit("j1", REQUEST)
    assert db.cancel_if_queued("j1", "cancelled by test") and not db.cancel_if_queued("j1", "again")
    assert not db.start_if_queued("j1", {"hosts": ["a"], "spare_hosts": []}, {"host": "h", "port": 1, "pid": 1})
    db.close()
    copy = sqlite3.connect(backup_path(tmp_path / "coordinator.db"))
    try:
        (state, request), = copy.execute("SELECT state, request FROM jobs").fetchall()
    finally:
        copy.close()
    assert state == states.CANCELLED and json.loads(request) == REQUEST
