"""The health service end to end, with real processes: each injected health signal leads to its
action, and the run still ends bitwise equal to the fault-free one, losing and repeating no step.

thermal -> live migration (the rank hands its own state to a spare at a step boundary)
uncorrectable ECC / Xid 79 -> failover from a healthy replica (the suspect's memory is not trusted)
corrupt -> the fingerprint vote names the rank, its state is replaced from a replica
nan -> the NaN is caught before the update and the rank replaced from a replica
slow -> the straggler is migrated off its device
"""
import os
import re

import pytest

from hotspare.health.lifecycle import State
from hotspare.health.registry import Registry
from hotspare.testing.inproc import run_inproc
from hotspare.testing.local import REPO

ARGS = ["--model", "tiny", "--steps", "60"]
FAST = ["--telemetry", "simulated", "--telemetry-period", "0.2"]


@pytest.fixture(scope="module")
def reference():
    result = run_inproc(ARGS, extra=FAST)
    assert result.code == 0, result.output
    r = result.report
    assert r["failures_total"] == 0 and r["migrations_total"] == 0 and not r["health_events"], result.output
    return result.digest


def run(tmp_path, inject, extra=()):
    db = tmp_path / "health.json"
    result = run_inproc(ARGS, inject=inject, extra=[*FAST, "--health-db", str(db), *extra])
    assert result.code == 0, result.output
    return result, Registry(db)


def assert_bitwise(result, reference):
    r = result.report
    assert r["final_state_digest"] == reference, "the run with a health fault diverged"
    assert r["replicas_consistent"] and r["steps_completed"] == 60 and r["steps_repeated"] == 0
    return r


def states(registry, device):
    return [t.dst.value for t in registry.get(device).history]


def test_thermal_live_migrates_the_rank_and_quarantines_the_device(tmp_path, reference):
    result, reg = run(tmp_path, ["thermal:rank=1:temp=92:step=10"])
    r = assert_bitwise(result, reference)
    assert r["failures_total"] == 0, "a live migration is not a failure"
    (m,) = r["migrations"]
    assert (m["rank"], m["rule"], m["outcome"], m["lost_steps"]) == (1, "temp-limit", "migrated", 0)
    assert m["device"].endswith("/cpu1") and m["bytes_transferred"] > 0 and m["downtime_s"] > 0
    assert "MIGRATED rank 1" in result.output and "handed over directly" in result.output
    # cordoned -> draining -> quarantined -> diagnostics passed twice -> healthy again
    assert states(reg, m["device"])[:3] == ["cordoned", "draining", "quarantined"]
    assert reg.get(m["device"]).state == State.HEALTHY, result.output


def test_uncorrectable_ecc_fails_over_from_a_replica(tmp_path, reference):
    result, reg = run(tmp_path, ["ecc:rank=2:kind=uncorrectable:step=10"])
    r = assert_bitwise(result, reference)
    (f,) = r["failures"]
    assert (f["kind"], f["rank"], f["recovery_path"], f["lost_steps"]) == ("health:ecc-uncorrectable", 2,
                                                                            "memory", 0)
    assert f["source_rank"] != 2 and f["detection_latency_s"] is not None
    assert r["migrations_total"] == 0, "an untrusted memory is never the source of a migration"
    assert "cordoned" in states(reg, f"{reg.devices()[0].node}/cpu2")


@pytest.mark.slow   # the same failover/report paths as the ECC test and a policy unit test
def test_gpu_lost_xid_79_fails_over(tmp_path, reference):
    result, _ = run(tmp_path, ["xid:rank=0:code=79:step=10"])
    (f,) = assert_bitwise(result, reference)["failures"]
    assert (f["kind"], f["rank"], f["lost_steps"]) == ("health:gpu-lost", 0, 0)


def test_corrupt_parameter_is_found_by_the_fingerprint_vote(tmp_path, reference):
    # A vote every step: the corrupt replica is caught before its gradients reach the others.
    result, _ = run(tmp_path, ["corrupt:rank=3:step=23"], extra=["--fingerprint-every", "1"])
    (f,) = assert_bitwise(result, reference)["failures"]
    assert (f["kind"], f["rank"], f["recovery_path"], f["lost_steps"]) == ("health:fingerprint-mismatch", 3,
                                                                            "memory", 0)
    assert f["source_rank"] != 3
    # the fault reaches the worker during step 23 and flips the bit as the next step begins
    assert re.search(r"VOTE .* differ from the other 3 replicas at step 2[4-6] ", result.output), result.output


@pytest.mark.slow   # run by .ci/run after the default suite (the default suite's budget: README)
def test_corrupt_parameter_between_periodic_votes_is_caught_at_the_next_one(tmp_path):
    # The default vote period (10): caught at step 30, replaced from a replica, and the run goes
    # on with consistent replicas. The averaged updates of steps 24-29 may have carried gradients
    # computed from the corrupt value (here one flipped low mantissa bit is often rounded away),
    # so the bitwise oracle is not promised at this period, and hotspare says so.
    result, _ = run(tmp_path, ["corrupt:rank=3:step=23"])
    r = result.report
    (f,) = r["failures"]
    assert (f["kind"], f["rank"], f["lost_steps"]) == ("health:fingerprint-mismatch", 3, 0)
    assert r["replicas_consistent"] and r["steps_completed"] == 60 and r["steps_repeated"] == 0
    assert re.search(r"VOTE .* differ from the other 3 replicas at step 30 ", result.output), result.output
    assert "may have reached the other replicas" in result.output


def test_nan_gradients_on_one_rank_never_reach_the_others(tmp_path, reference):
    result, _ = run(tmp_path, ["nan:rank=1:step=20"])
    (f,) = assert_bitwise(result, reference)["failures"]
    assert (f["kind"], f["rank"], f["lost_steps"]) == ("health:nonfinite", 1, 0)


@pytest.mark.slow   # run by .ci/run after the default suite (the default suite's budget: README)
def test_straggler_is_migrated_off_its_device(tmp_path, reference):
    # The default asks for 5 windows of 10 steps in a row; a user rules file may be quicker.
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nname = "straggler"\nheld = 2\n')
    result, _ = run(tmp_path, ["slow:rank=2:factor=2:step=2"], extra=["--health-rules", str(rules)])
    r = assert_bitwise(result, reference)
    assert r["failures_total"] == 0
    (m,) = r["migrations"]
    assert (m["rank"], m["rule"], m["lost_steps"]) == (2, "straggler", 0)


@pytest.mark.slow   # the same failover/report paths as the ECC test and a policy unit test
def test_without_a_spare_a_hot_device_is_reported_not_moved(tmp_path, reference):
    db = tmp_path / "health.json"
    result = run_inproc(ARGS, spares=0, inject=["thermal:rank=1:temp=92:step=5"],
                     extra=[*FAST, "--health-db", str(db)])
    assert result.code == 0, result.output
    assert result.digest == reference
    assert result.report["migrations_total"] == 0 and result.report["health_events"]
    assert "no warm spare" in result.output


@pytest.mark.slow   # run by .ci/run after the default suite (the default suite's budget: README)
def test_nan_that_follows_the_rank_to_a_new_device_is_a_bug(tmp_path):
    result = run_inproc(["30"], script=REPO / "tests" / "scripts" / "nan_data.py", extra=FAST,
                     env={"NAN_RANK": "1", "NAN_STEP": "12"})
    assert result.code == 1, result.output
    assert "numerical problem in the script" in result.output
    assert result.report["outcome"] == "stopped"


LONG = ["--model", "tiny", "--steps", "200"]


@pytest.fixture(scope="module")
def long_reference():
    result = run_inproc(LONG, extra=FAST)
    assert result.code == 0, result.output
    return result.digest


def start_job(tmp_path, *extra):
    """A running job, returned once its first generation started."""
    import subprocess
    import sys
    report = tmp_path / "report.json"
    proc = subprocess.Popen([sys.executable, "-m", "hotspare", "run", "--nproc", "4", "--spares", "1", *FAST,
                             "--report", str(report), *extra, "--", str(REPO / "examples" / "gpt_stdlib.py"),
                             *LONG], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "HOTSPARE_RUN_DIR": str(tmp_path / "runs")})
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "START" in line:
            return proc, lines, report
    raise AssertionError("".join(lines))


def finish_job(proc, lines, report):
    import json
    lines += proc.stdout.readlines()
    assert proc.wait(timeout=300) == 0, "".join(lines)
    return json.loads(report.read_text()), "".join(lines)


def hotspare_cli(tmp_path, *argv):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "hotspare", *argv], capture_output=True, text=True,
                          env={**os.environ, "HOTSPARE_RUN_DIR": str(tmp_path / "runs")})


@pytest.mark.slow   # run by .ci/run after the default suite (the default suite's budget: README)
def test_operator_drain_moves_the_rank_off_a_running_job(tmp_path, long_reference):
    db = tmp_path / "health.json"
    proc, lines, report = start_job(tmp_path, "--health-db", str(db))
    device = f"{Registry(db).devices()[0].node}/cpu2"
    drain = hotspare_cli(tmp_path, "drain", "--db", str(db), device, "--reason", "fan replacement")
    assert drain.returncode == 0, drain.stdout + drain.stderr
    r, out = finish_job(proc, lines, report)
    (m,) = r["migrations"]
    assert (m["rank"], m["rule"], m["outcome"], m["lost_steps"]) == (2, "operator-drain", "migrated", 0)
    assert r["final_state_digest"] == long_reference and r["steps_repeated"] == 0


@pytest.mark.slow   # run by .ci/run after the default suite (the default suite's budget: README)
def test_hotspare_inject_reaches_a_running_job_and_bad_specs_harm_nothing(tmp_path, long_reference):
    proc, lines, report = start_job(tmp_path, "--allow-inject")
    bad = hotspare_cli(tmp_path, "inject", "thermal:rank=1")
    assert bad.returncode == 2 and "missing temp" in bad.stderr
    nobody = hotspare_cli(tmp_path, "inject", "--job", "1", "kill:rank=1")
    assert nobody.returncode == 1 and "no running hotspare job with launcher pid 1" in nobody.stderr
    armed = hotspare_cli(tmp_path, "inject", "ecc:rank=1:kind=uncorrectable")
    assert armed.returncode == 0 and "armed" in armed.stdout, armed.stdout + armed.stderr
    r, out = finish_job(proc, lines, report)
    (f,) = r["failures"]
    assert (f["kind"], f["rank"], f["lost_steps"]) == ("health:ecc-uncorrectable", 1, 0)
    assert r["final_state_digest"] == long_reference and r["steps_repeated"] == 0
    assert not list((tmp_path / "runs").glob("*.json")), "the run file goes with the launcher"


def test_admission_checks_run_before_the_devices_take_work():
    result = run_inproc(["--model", "tiny", "--steps", "5"], nproc=1, spares=1,
                     extra=[*FAST, "--admission", "small"])
    assert result.code == 0, result.output
    assert result.output.count("ADMISSION") == 3 and ": pass" in result.output


@pytest.mark.slow   # run by .ci/run after the default suite
def test_a_vote_on_a_step_without_backward_is_judged_when_the_step_ends(tmp_path):
    # Steps 0, 5, 10, ... only evaluate, so the votes of steps 0, 10, 20, 30 have no gradient
    # bucket to wait for them: each is judged as its step ends. The bit flipped on rank 1 as
    # step 20 begins is caught by that vote, before any update used it: the run still ends
    # bitwise equal to the fault-free one.
    script = REPO / "tests" / "scripts" / "eval_steps.py"
    clean = run_inproc(["36"], script=script, extra=FAST)
    result = run_inproc(["36"], script=script, inject=["corrupt:rank=1:step=19"], extra=FAST)
    assert clean.code == 0 and result.code == 0, result.output
    r = result.report
    (f,) = r["failures"]
    assert (f["kind"], f["rank"], f["lost_steps"]) == ("health:fingerprint-mismatch", 1, 0)
    assert re.search(r"VOTE .* differ from the other 3 replicas at step 20 ", result.output), result.output
    assert r["final_state_digest"] == clean.digest
    assert r["replicas_consistent"] and r["steps_completed"] == 36 and r["steps_repeated"] == 0
