"""The persisted device registry: what survives a restart, how pollers see changes, that separate
processes writing at once lose nothing, and that a damaged file is refused, never reset. The
core of it runs twice: in a JSON file and in a SQLite database (the coordinator service's)."""
import json
import math
import os
import subprocess
import sys
import textwrap
import time

import pytest

from hotspare.errors import ConfigError, InvalidTransition
from hotspare.health.lifecycle import State
from hotspare.health.registry import Registry, RegistryError, UnknownDevice, default_path
from hotspare.health.types import Reading


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        self.t += 1.0
        return self.t


@pytest.fixture
def reg_path(tmp_path):
    return tmp_path / "registry" / "health.json"


@pytest.fixture(params=["health.json", "coordinator.db"])
def any_path(request, tmp_path):
    """A registry in a JSON file, or in a table of a SQLite database."""
    return tmp_path / "registry" / request.param


def test_everything_survives_a_new_process_view(any_path):
    reg_path = any_path
    reg = Registry(reg_path, clock=Clock())
    reg.ensure("n1/gpu0")
    reg.record_reading(Reading("n1/gpu0", 50.0, "simulated", {"temp_c": 92.0, "xids": (79, 48)}, rank=3))
    reg.record_reading(Reading("n1/gpu0", 51.0, "runtime", {"straggler_score": 0.6}))
    reg.assign("n1/gpu0", 3, "job-a")
    reg.cordon("n1/gpu0", "thermal margin -3C", actor="rule:thermal-margin")

    again = Registry(reg_path).get("n1/gpu0")         # a fresh instance reads the file
    assert again.state is State.CORDONED
    assert (again.reason, again.actor) == ("thermal margin -3C", "rule:thermal-margin")
    assert [(t.src, t.dst) for t in again.history] == [(State.HEALTHY, State.CORDONED)]
    assert again.readings["simulated"].metrics == {"temp_c": 92.0, "xids": (79, 48)}
    assert again.readings["simulated"].rank == 3
    assert again.last_reading.source == "runtime"
    assert (again.rank, again.job) == (3, "job-a")
    assert again.remediations == (again.since,)       # a rule took it out of service
    assert again.node == "n1"
    if reg_path.suffix == ".json":
        assert json.loads(reg_path.read_text())["devices"]["n1/gpu0"]["state"] == "cordoned"


def test_default_path_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HOTSPARE_HEALTH_DB", str(tmp_path / "x.json"))
    assert default_path() == tmp_path / "x.json"
    monkeypatch.delenv("HOTSPARE_HEALTH_DB")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_path() == tmp_path / ".hotspare" / "health.json"
    assert Registry().path == tmp_path / ".hotspare" / "health.json"


def test_revision_lets_a_poller_see_only_what_changed(reg_path):
    reg = Registry(reg_path)
    assert reg.revision() == 0 and reg.devices() == []
    reg.ensure("n1/gpu0")
    reg.ensure("n1/gpu1")
    seen = reg.revision()
    reg.ensure("n1/gpu0")                              # exists: no write, no new revision
    assert reg.revision() == seen
    Registry(reg_path).cordon("n1/gpu1", "operator says so")   # "another process" (the CLI)
    rev, changed = reg.changed_since(seen)
    assert rev == seen + 1 and [r.device for r in changed] == ["n1/gpu1"]
    assert reg.changed_since(rev) == (rev, [])


def test_a_poller_reads_the_file_only_when_another_process_changed_it(reg_path):
    # The launcher polls every second for operator commands: an unchanged file is a stat.
    reg = Registry(reg_path)
    reg.ensure("n1/gpu0")
    reads = []
    real = reg.store.read
    reg.store.read = lambda: reads.append(1) or real()
    rev, _ = reg.changed_since(0)
    for _ in range(5):
        assert reg.changed_since(rev) == (rev, [])
    assert len(reads) <= 1
    for i in range(3):         # three writes by "another process" in quick succession: each seen
        Registry(reg_path).cordon("n1/gpu0", f"operator, take {i}") if i % 2 == 0 else \
            Registry(reg_path).uncordon("n1/gpu0", "back")
        rev2, changed = reg.changed_since(rev)
        assert rev2 == rev + 1 and [r.device for r in changed] == ["n1/gpu0"], i
        rev = rev2


def test_full_way_out_and_back_through_diagnostics(reg_path):
    reg = Registry(reg_path, passes_required=3, clock=Clock())
    reg.ensure("n1/gpu0")
    reg.assign("n1/gpu0", 0, "job-a")
    reg.drain("n1/gpu0", "xid 79", actor="rule:gpu-lost")
    assert reg.get("n1/gpu0").state is State.DRAINING
    with pytest.raises(InvalidTransition, match="rank 0 of job job-a still runs on it"):
        reg.quarantine("n1/gpu0", "drained", actor="rule:gpu-lost")
    reg.release("n1/gpu0")
    reg.quarantine("n1/gpu0", "rank moved off", actor="rule:gpu-lost")
    reg.diagnostics_passed("n1/gpu0")
    reg.diagnostics_failed("n1/gpu0", "matmul mismatch")
    assert reg.get("n1/gpu0").diagnostics_passes == 0
    assert reg.diagnostics_passed("n1/gpu0").state is State.QUARANTINED
    assert reg.diagnostics_passed("n1/gpu0").state is State.QUARANTINED
    rec = reg.diagnostics_passed("n1/gpu0")
    assert rec.state is State.HEALTHY and rec.actor == "diagnostics" and "3/3" in rec.reason
    assert [t.dst.value for t in rec.history] == ["cordoned", "draining", "quarantined", "healthy"]
    with pytest.raises(InvalidTransition, match="not quarantined"):
        reg.diagnostics_passed("n1/gpu0")


def test_convenience_moves_are_idempotent_and_operator_cordons_are_not_remediations(reg_path):
    reg = Registry(reg_path)
    reg.ensure("n1/gpu0")
    first = reg.cordon("n1/gpu0", "maintenance")
    assert reg.cordon("n1/gpu0", "again").revision == first.revision
    assert first.remediations == ()
    reg.drain("n1/gpu0", "move it")
    assert reg.uncordon("n1/gpu0").state is State.HEALTHY       # draining -> cordoned -> healthy
    assert [t.dst.value for t in reg.get("n1/gpu0").history][-2:] == ["cordoned", "healthy"]
    reg.retire("n1/gpu0", "RMA")
    with pytest.raises(InvalidTransition, match="retired is terminal"):
        reg.uncordon("n1/gpu0")
    reg.forget("n1/gpu0")
    assert reg.ensure("n1/gpu0").state is State.HEALTHY          # the replacement part starts fresh


def test_bad_names_unknown_devices_and_refused_moves_leave_the_file_alone(reg_path):
    reg = Registry(reg_path)
    reg.ensure("n1/gpu0")
    before = reg_path.read_bytes()
    with pytest.raises(ConfigError, match="must look like NODE/KINDINDEX"):
        reg.cordon("gpu0", "x")
    with pytest.raises(UnknownDevice, match="did you mean n1/gpu0"):
        reg.cordon("n1/gpu9", "x")
    with pytest.raises(InvalidTransition, match="from healthy to quarantined"):
        reg.transition("n1/gpu0", "quarantined", reason="x", actor="operator")
    with pytest.raises(InvalidTransition, match="only operator may"):
        reg.transition("n1/gpu0", "retired", reason="x", actor="rule:lemon")
    assert reg_path.read_bytes() == before
    assert sorted(os.listdir(reg_path.parent)) == ["health.json", "health.json.lock"]   # no temp files


def test_readings_are_stored_as_strict_json(reg_path):
    import numpy as np
    reg = Registry(reg_path)
    reg.record_readings([Reading("n2/cpu0", 1.0, "simulated", {"temp_c": np.float32(71.5),
                                                               "step_compute_s": math.inf,
                                                               "nonfinite": True})])
    json.loads(reg_path.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    rec = reg.get("n2/cpu0")
    assert rec.state is State.HEALTHY and rec.actor == "source:simulated"
    assert rec.readings["simulated"].metrics == {"temp_c": 71.5, "step_compute_s": "inf", "nonfinite": True}
    with pytest.raises(ConfigError, match="metric 'blob' has a value of type dict"):
        reg.record_reading(Reading("n2/cpu0", 2.0, "simulated", {"blob": {"a": 1}}))


@pytest.mark.parametrize("content,message", [
    ("{not json", "is not valid JSON"),
    ("", "is not valid JSON"),
    ('{"devices": {}}', "is not a hotspare health registry"),
    ('{"format": "hotspare-health-registry", "schema": 99, "revision": 0, "devices": {}}',
     "schema 99, written by a newer hotspare"),
    ('{"format": "hotspare-health-registry", "schema": 1, "revision": 0, "devices": {"a/gpu0": {}}}',
     "malformed entry"),
])
def test_a_damaged_file_is_refused_never_reset(reg_path, content, message):
    reg_path.parent.mkdir(parents=True)
    reg_path.write_text(content)
    reg = Registry(reg_path)
    with pytest.raises(RegistryError, match=message) as e:
        reg.devices()
    if "newer" not in message:
        assert "never resets it" in str(e.value)
    with pytest.raises(RegistryError):
        reg.ensure("a/gpu1")
    assert reg_path.read_text() == content


WRITER = textwrap.dedent("""
    import sys
    from hotspare.health.registry import Registry
    path, me, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    reg = Registry(path)
    for i in range(n):
        reg.ensure(f"w{me}/gpu{i}")                            # a new record: touches the device map
        reg.record_remediation("shared/gpu0", when=me * 1000 + i)   # the same record from everyone
""")

READER = textwrap.dedent("""
    import json, sys, time
    from hotspare.health.registry import Registry
    path, seconds = sys.argv[1], float(sys.argv[2])
    reg, reads, end = Registry(path), 0, time.time() + seconds
    while time.time() < end:
        if path.endswith(".json"):
            json.loads(open(path).read())      # raw: the file on disk is always complete JSON
        reg.devices()
        reads += 1
    print(reads)
""")


def test_concurrent_writers_in_separate_processes_lose_nothing(any_path, tmp_path):
    reg_path, writers, per = any_path, 4, 20
    Registry(reg_path).ensure("shared/gpu0")
    (tmp_path / "writer.py").write_text(WRITER)
    (tmp_path / "reader.py").write_text(READER)
    reader = subprocess.Popen([sys.executable, str(tmp_path / "reader.py"), str(reg_path), "4"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "writer.py"), str(reg_path), str(w), str(per)],
                              stderr=subprocess.PIPE, text=True) for w in range(writers)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    out, err = reader.communicate(timeout=60)
    assert reader.returncode == 0, f"a reader saw a broken file: {err}"
    assert int(out) > 0

    reg = Registry(reg_path)
    names = {r.device for r in reg.devices()}
    assert names == {"shared/gpu0"} | {f"w{w}/gpu{i}" for w in range(writers) for i in range(per)}
    assert sorted(reg.get("shared/gpu0").remediations) == sorted(
        float(w * 1000 + i) for w in range(writers) for i in range(per))
    assert reg.revision() == 1 + 2 * writers * per      # every write bumped it exactly once
    assert not [f for f in os.listdir(reg_path.parent) if f.endswith(".tmp")]


def test_polling_an_unchanged_registry_does_not_reparse(any_path, monkeypatch):
    reg = Registry(any_path)
    reg.ensure("n1/gpu0")
    calls = []
    real = Registry._parse
    monkeypatch.setattr(Registry, "_parse", lambda self, text: calls.append(1) or real(self, text))
    t0 = time.perf_counter()
    for _ in range(200):
        reg.changed_since(reg.revision())
    assert calls == [] and time.perf_counter() - t0 < 2.0


def test_a_damaged_registry_in_a_database_is_refused_never_reset(tmp_path):
    import sqlite3
    path = tmp_path / "coordinator.db"
    Registry(path).ensure("a/gpu0")
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE health_registry SET doc = '{not json'")
    reg = Registry(path)
    with pytest.raises(RegistryError, match="is not valid JSON"):
        reg.devices()
    with pytest.raises(RegistryError):
        reg.ensure("a/gpu1")
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT doc FROM health_registry").fetchone()[0] == "{not json"
    other = tmp_path / "not-a.db"
    other.write_text("plain text, not a database")
    with pytest.raises(RegistryError, match="not-a.db: cannot"):
        Registry(other).devices()


def test_a_registry_shares_its_database_with_the_service_state(tmp_path):
    from hotspare.service.db import StateDB
    db = StateDB(tmp_path)
    db.submit("j1", {"script": "x.py"})
    reg = Registry(db.path)
    reg.ensure("hostb/cpu0")
    reg.cordon("hostb/cpu0", "hot", actor="rule:temp-limit")
    assert db.job("j1").state == "queued"
    assert Registry(db.path).get("hostb/cpu0").state is State.CORDONED


def test_a_file_that_cannot_be_written_is_a_registry_error_and_leaves_no_temp_file(reg_path, monkeypatch):
    # EMFILE in a launcher out of descriptors, ENOSPC on a full disk: a clear RegistryError, the
    # old content kept, no temporary file left behind.
    import errno
    import tempfile

    reg = Registry(reg_path)
    reg.ensure("n1/gpu0")
    before = reg_path.read_bytes()

    def no_descriptors(*a, **k):
        raise OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr(tempfile, "mkstemp", no_descriptors)
    with pytest.raises(RegistryError, match="cannot write it: .*Too many open files"):
        reg.cordon("n1/gpu0", "hot")
    monkeypatch.undo()

    def full_disk(fd, *a, **k):
        os.close(fd)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fdopen", full_disk)
    with pytest.raises(RegistryError, match="cannot write it: .*No space left"):
        reg.cordon("n1/gpu0", "hot")
    monkeypatch.undo()
    assert reg_path.read_bytes() == before
    assert sorted(os.listdir(reg_path.parent)) == ["health.json", "health.json.lock"]
