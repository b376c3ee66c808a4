"""End to end, real processes and real signals: a run with injected faults must end with the
same model state, bit for bit, as the same run without faults, losing and repeating no step."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from hotspare.testing.inproc import fault_free, run_inproc
from hotspare.testing.local import EXAMPLE, REPO

ARGS = ["--model", "tiny", "--steps", "40"]


@pytest.fixture(scope="module")
def reference():
    result = fault_free(ARGS)
    assert result.code == 0, result.output
    assert result.report["failures_total"] == 0 and result.report["replicas_consistent"]
    return result.digest


def explain(result) -> str:
    """Every failure record and the job's log without its step lines: what an unexpected
    failure count needs to be understood."""
    return "\n".join([json.dumps(f) for f in result.report["failures"]] +
                     [line for line in result.output.splitlines() if " step " not in line])


def assert_recovered(result, reference, failures):
    assert result.code == 0, result.output
    r = result.report
    assert r["final_state_digest"] == reference, "faulted run diverged from the fault-free run"
    assert r["replicas_consistent"] and r["steps_completed"] == 40 and r["steps_repeated"] == 0
    assert r["failures_total"] == failures and r["recovered_zero_loss"] == failures, explain(result)
    for f in r["failures"]:
        assert f["recovery_path"] == "memory" and f["lost_steps"] == 0, f
        assert f["downtime_s"] is not None and f["detection_latency_s"] is not None
    assert "recovered with zero lost steps: %d/%d (100%%)" % (failures, failures) in result.output
    return r


def test_kill_mid_run_is_replaced_by_spare_bitwise_equal(reference):
    r = assert_recovered(run_inproc(ARGS, inject=["kill:rank=2:step=17"]), reference, 1)
    f = r["failures"][0]
    assert (f["kind"], f["rank"], f["step"], f["source_rank"]) == ("SIGKILL", 2, 17, 0)
    assert f["replacement"] == "w4" and f["bytes_transferred"] > 0
    assert set(f["phases_s"]) == {"detect", "decide", "rebuild_groups", "transfer_state", "first_committed_step"}


def test_kill_during_first_and_during_last_step(reference):
    assert_recovered(run_inproc(ARGS, inject=["kill:rank=0:step=0"]), reference, 1)
    assert_recovered(run_inproc(ARGS, inject=["kill:rank=3:step=39"]), reference, 1)


def test_two_ranks_killed_in_the_same_step_with_one_spare_start_a_cold_replacement(reference):
    assert_recovered(run_inproc(ARGS, inject=["kill:rank=0:step=9", "kill:rank=3:step=9"]), reference, 2)


@pytest.mark.slow   # run by .ci/run after the default suite (the default suite's budget: README)
def test_second_failure_finds_the_reprovisioned_warm_spare():
    # The spare started after the first failure (forked from the zygote: ready within a second)
    # is warm for the second, 100 steps (3 s or more) later.
    args = ["--model", "tiny", "--steps", "140"]
    ref = run_inproc(args, spares=1)
    r = run_inproc(args, spares=1, inject=["kill:rank=1:step=20", "kill:rank=1:step=120"])
    assert r.code == 0, r.output
    assert r.digest == ref.digest and r.report["steps_repeated"] == 0
    assert len(r.report["failures"]) == 2, explain(r)
    first, second = r.report["failures"]
    assert first["replacement"] == "w4" and second["replacement"] == "w5"   # w5: the re-provisioned spare
    assert second["spare_was_warm"] and first["spare_was_warm"]
    assert "spawn: workers and spares fork from a zygote" in r.output


@pytest.mark.slow   # run by .ci/run after the default suite (the default suite's budget: README)
def test_failover_across_node_agents(reference):
    """Two node agents (--local-nodes 2), each with its own device slots, talking to the
    coordinator over TCP: a rank on one node is taken over by the spare on the other, and the
    re-provisioned spare goes where a slot is free. The workers start as fresh interpreters
    (--spawn exec), the other way to start them, so it stays tested end to end."""
    result = run_inproc(ARGS, inject=["kill:rank=1:step=12"], extra=["--local-nodes", "2", "--spawn", "exec"])
    r = assert_recovered(result, reference, 1)
    nodes = r["nodes"]
    assert len(nodes) == 2 and all(len(n["devices"]) >= 2 for n in nodes.values())
    where = {w["worker"]: name for name, n in nodes.items() for w in n["workers"]}
    assert r["failures"][0]["replacement"] == "w4" and where["w1"] != where["w4"], nodes   # crossed nodes
    assert where["w5"] == where["w1"]            # the new spare took the slot the dead rank freed
    assert f"RESUMED rank 1 -> w4 on {where['w4']}" in result.output
    assert "spawn: each worker and spare starts as a fresh interpreter" in result.output


def test_script_bug_is_not_failed_over_forever():
    r = run_inproc(["30"], script=REPO / "tests" / "scripts" / "buggy.py", env={"BUG_RANK": "1", "BUG_STEP": "12"})
    assert r.code == 1, r.output
    assert "looks like a bug in the training script" in r.output
    assert "KeyError: 'missing_key'" in r.output and 'buggy.py", line' in r.output
    assert r.report["outcome"] == "stopped" and r.report["failures_total"] == 1


@pytest.mark.slow   # run by .ci/run after the default suite (the default suite's budget: README)
def test_same_script_runs_under_plain_torchrun_with_the_same_digest(reference, tmp_path):
    out = tmp_path / "stats.json"
    with socket.socket() as sock:      # torchrun's --master-port 0 does not reach the workers
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                           "--master-port", str(port), str(EXAMPLE), *ARGS, "--stats", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(out.read_text())["digest"] == reference


@pytest.mark.parametrize("argv, message", [
    (["--bogus-flag", "x.py"], "unrecognized arguments"),
    (["--nproc", "4", "--", "no/such/script.py"], "not found"),
    (["--nproc", "0", "--", str(EXAMPLE)], "--nproc must be at least 1"),
    (["--spares", "-1", "--", str(EXAMPLE)], "--spares must be 0 or more"),
    (["--inject", "kill:rank=2", "--", str(EXAMPLE)], "missing step"),
    (["--inject", "explode:rank=2:step=1", "--", str(EXAMPLE)], "unknown fault kind"),
    (["--nproc", "2", "--inject", "kill:rank=5:step=1", "--", str(EXAMPLE)], "rank 5 does not exist"),
    (["--local-nodes", "0", "--", str(EXAMPLE)], "--local-nodes 0 needs --remote-nodes K"),
    (["--nproc", "2", "--spares", "0", "--local-nodes", "3", "--", str(EXAMPLE)], "more than the 2 device slots"),
    (["--spawn", "clone", "--", str(EXAMPLE)], "invalid choice: 'clone'"),
])
def test_bad_input_gets_a_clear_error_and_exit_2(argv, message):
    proc = subprocess.run([sys.executable, "-m", "hotspare", "run", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr


def test_help_teaches_the_injection_grammar():
    proc = subprocess.run([sys.executable, "-m", "hotspare", "run", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "kill:rank=R:step=S" in proc.stdout and "--spares" in proc.stdout


def _interrupt(marker: str, until, extra=(), inject=()) -> tuple[str, float]:
    """Start a long job, send the launcher one SIGINT as soon as ``until(line)`` holds; its whole
    output and how long it took to exit. ``marker`` is a --corpus-bytes no other job uses: it
    finds this job's workers, none of which may be left behind."""
    cmd = [sys.executable, "-m", "hotspare", "run", "--nproc", "2", "--spares", "1", *extra]
    for spec in inject:
        cmd += ["--inject", spec]
    proc = subprocess.Popen([*cmd, "--", str(EXAMPLE), "--model", "tiny", "--steps", "100000",
                             "--corpus-bytes", marker],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if until(line):
                break
        running = _pgrep(f"--corpus-bytes {marker}")
        assert len(running) >= 3, running      # the launcher and its workers: the check below would see them
        proc.send_signal(signal.SIGINT)
        t0 = time.time()
        out, _ = proc.communicate(timeout=60)
        took = time.time() - t0
    finally:
        if proc.poll() is None:                # a failed check leaves no job running (its workers die with it)
            proc.kill()
            proc.wait()
    output = "".join(lines) + out
    assert proc.returncode == 130, output
    assert "interrupted by the user" in out, output
    left = _pgrep(f"--corpus-bytes {marker}")
    assert left == [], left
    assert _pgrep(rf"zygote import serve; serve\([0-9]+, {proc.pid},") == [], "the launcher's zygote outlived it"
    return output, took


def _pgrep(pattern: str) -> list[str]:
    """The pids whose command line matches (``--``: a pattern may start with a dash)."""
    found = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True)
    assert found.returncode in (0, 1), found.stderr
    return found.stdout.split()


def test_ctrl_c_stops_the_job_at_once_and_leaves_no_worker_behind():
    output, took = _interrupt("1234321", lambda line: " step " in line and "gen 1" in line)
    assert took < 10, output


@pytest.mark.slow   # run by .ci/run after the default suite (the default suite's budget: README)
def test_ctrl_c_cuts_quarantine_diagnostics_short(tmp_path):
    # A straggler is migrated off its device, which then drains into quarantine diagnostics
    # (seconds of burn-in on a loaded machine, minutes on a GPU); Ctrl-C must not wait for them.
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nname = "straggler"\nheld = 2\n')
    # Wait for the diagnostics to start: they start when the old worker has left its device, which
    # on a loaded machine can come after MIGRATED, or (with the hand-off done) before it.
    output, took = _interrupt("1234322", lambda line: "diagnostics started" in line,
                              extra=["--health-rules", str(rules)], inject=["slow:rank=1:factor=3:step=2"])
    assert took < 10, output
    assert "MIGRATE generation 2" in output and "diagnostics cut short, the job is stopping" in output, output
    assert "HEALTHY" not in output.split("diagnostics started", 1)[1], output    # no verdict from a cut-short run
