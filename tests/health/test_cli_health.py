"""``hotspare health / cordon / drain / uncordon`` as an operator runs them: real subprocesses on a real
registry file; output, exit codes and what ends up in the file."""
import json
import os
import subprocess
import sys

import pytest

from hotspare.health.registry import Registry
from hotspare.health.types import Reading


@pytest.fixture
def db(tmp_path):
    reg = Registry(tmp_path / "health.json")
    reg.ensure("n1/gpu0")
    reg.ensure("n1/gpu1")
    reg.record_reading(Reading("n1/gpu0", 100.0, "simulated", {"temp_c": 92.0, "xids": (79,)}))
    reg.assign("n1/gpu0", 3, "job-a")
    return reg.path


def hotspare(*args, env_db=None):
    env = dict(os.environ, HOTSPARE_SLURM="off")    # these tests are about the registry, not Slurm
    env.pop("HOTSPARE_HEALTH_DB", None)
    if env_db is not None:
        env["HOTSPARE_HEALTH_DB"] = str(env_db)
    return subprocess.run([sys.executable, "-m", "hotspare", *map(str, args)], capture_output=True,
                          text=True, timeout=60, env=env)


def state_in_file(path, device):
    return json.loads(path.read_text())["devices"][device]["state"]


def test_health_table_shows_state_reason_readings_and_rank(db):
    out = hotspare("health", "--db", db)
    assert out.returncode == 0, out.stderr
    header, gpu0, gpu1 = out.stdout.splitlines()[:3]
    assert header.split() == ["DEVICE", "STATE", "SINCE", "REASON", "LAST", "READINGS", "RANK/JOB"]
    assert gpu0.startswith("n1/gpu0") and "healthy" in gpu0 and "92C, xid 79 (simulated" in gpu0
    assert gpu0.endswith("3/job-a") and gpu1.endswith("-")
    assert f"registry {db}, revision" in out.stdout


def test_cordon_drain_uncordon_round_trip(db):
    out = hotspare("cordon", "n1/gpu1", "--reason", "fan noise", "--db", db)
    assert (out.returncode, out.stdout.strip()) == (0, "n1/gpu1: healthy -> cordoned (fan noise)")
    assert state_in_file(db, "n1/gpu1") == "cordoned"

    again = hotspare("cordon", "n1/gpu1", "--reason", "still noisy", "--db", db)
    assert again.returncode == 0 and "already cordoned" in again.stdout and "fan noise" in again.stdout

    out = hotspare("drain", "n1/gpu1", "--db", db)
    assert (out.returncode, out.stdout.strip()) == (0, "n1/gpu1: cordoned -> draining (drained by operator)")
    out = hotspare("uncordon", "n1/gpu1", "--db", db)
    assert out.stdout.strip() == "n1/gpu1: draining -> cordoned -> healthy (uncordoned by operator)"
    assert state_in_file(db, "n1/gpu1") == "healthy"

    detail = hotspare("health", "n1/gpu1", "--db", db)
    assert detail.returncode == 0, detail.stderr
    history = [l.split() for l in detail.stdout.splitlines() if " -> " in l]
    assert [(h[2], h[4], h[5]) for h in history] == [
        ("healthy", "cordoned", "operator:"), ("cordoned", "draining", "operator:"),
        ("draining", "cordoned", "operator:"), ("cordoned", "healthy", "operator:")]


def test_drain_from_healthy_walks_through_cordoned(db):
    out = hotspare("drain", "n1/gpu0", "--reason", "pcie x8", "--db", db)
    assert out.stdout.strip() == "n1/gpu0: healthy -> cordoned -> draining (pcie x8)"


def test_json_output_and_the_environment_variable(db):
    out = hotspare("health", "--json", env_db=db)           # no --db: $HOTSPARE_HEALTH_DB
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["registry"] == str(db)
    gpu0 = next(d for d in body["devices"] if d["device"] == "n1/gpu0")
    assert gpu0["state"] == "healthy" and gpu0["rank"] == 3 and gpu0["job"] == "job-a"
    assert gpu0["readings"]["simulated"]["metrics"]["xids"] == [79]


@pytest.mark.parametrize("args,message", [
    (["cordon", "gpu0", "--reason", "x"], "device name 'gpu0' must look like NODE/KINDINDEX"),
    (["drain", "n1/gpu7"], "no device 'n1/gpu7' in the health registry"),
    (["uncordon", "n1/gpu9"], "did you mean"),
    (["health", "n9"], "no device of node 'n9'"),
])
def test_bad_names_exit_2_with_a_message(db, args, message):
    before = db.read_bytes()
    out = hotspare(*args, "--db", db)
    assert out.returncode == 2, out
    assert message in out.stderr and out.stderr.startswith(f"hotspare {args[0]}: error: ")
    assert db.read_bytes() == before


def test_refused_moves_exit_2_and_say_what_is_allowed(db):
    reg = Registry(db)
    reg.release("n1/gpu0")
    reg.quarantine("n1/gpu0", "xid 79", actor="rule:gpu-lost")
    out = hotspare("uncordon", "n1/gpu0", "--db", db)
    assert out.returncode == 2
    assert "quarantined (xid 79): it returns to service only after passing the quarantine diagnostics 2 times" in out.stderr

    reg.retire("n1/gpu1", "RMA 1234")
    out = hotspare("uncordon", "n1/gpu1", "--db", db)
    assert out.returncode == 2
    assert "cannot move n1/gpu1 from retired to healthy (asked by operator)" in out.stderr
    assert "retired is terminal" in out.stderr


def test_cordon_needs_a_reason(db):
    out = hotspare("cordon", "n1/gpu0", "--db", db)
    assert out.returncode == 2 and "--reason" in out.stderr


def test_a_corrupt_registry_is_an_error_not_a_reset(tmp_path):
    db = tmp_path / "health.json"
    db.write_text('{"format": "hotspare-health-registry", "schema": 1, "devi')
    for args in (["health"], ["cordon", "n1/gpu0", "--reason", "x"]):
        out = hotspare(*args, "--db", db)
        assert out.returncode == 1 and "is not valid JSON" in out.stderr and "never resets it" in out.stderr
    assert db.read_text().endswith('"devi')


def test_empty_registry_says_where_devices_come_from(tmp_path):
    out = hotspare("health", "--db", tmp_path / "none.json")
    assert out.returncode == 0 and "no devices in" in out.stdout
    assert not (tmp_path / "none.json").exists()           # reading never creates the file


def test_help_teaches_states_registry_and_slurm():
    top = hotspare("--help")
    for cmd in ("health", "cordon", "drain", "uncordon"):
        assert cmd in top.stdout
    for cmd in ("health", "cordon", "drain", "uncordon"):
        text = " ".join(hotspare(cmd, "--help").stdout.split())
        assert "quarantined no work; diagnostics run" in text
        assert "cordoned -> healthy operator uncordon" in text
        assert "$HOTSPARE_HEALTH_DB" in text and "~/.hotspare/health.json" in text
        assert 'State=DRAIN Reason="hotspare: ..."' in text and "--slurm on" in text
