"""Ordinary faults of the launcher and the processes it starts: SIGTERM (a scheduler's
preemption), a script that never calls hotspare.init(), a spare killed while it boots, and
command-line values out of range. Each ends well and says so."""
import json
import os
import signal
import subprocess
import sys

import pytest

from hotspare.checkpoint import load
from hotspare.testing import run_job
from hotspare.testing.local import EXAMPLE, REPO

# load() warns that it assumes one process: that is the design.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ARGS = ["--model", "tiny", "--steps", "40"]
SCRIPTS = REPO / "tests" / "scripts"


def test_sigterm_writes_a_last_checkpoint_and_the_report_then_exits_143(tmp_path):
    report = tmp_path / "report.json"
    ckpts = tmp_path / "ckpts"
    proc = subprocess.Popen([sys.executable, "-m", "hotspare", "run", "--nproc", "2", "--spares", "1",
                             "--checkpoint-dir", str(ckpts), "--report", str(report), "--",
                             str(EXAMPLE), "--model", "tiny", "--steps", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if " step " in line and "gen 1" in line:
                break
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)        # bounded: the job does not run on
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(lines) + out
    assert proc.returncode == 143, output
    rep = json.loads(report.read_text())
    assert rep["outcome"] == "preempted" and "SIGTERM" in rep["message"], rep["message"]
    (last,) = rep["checkpoints"]
    step, _, _, info = load(str(ckpts))                   # signed, complete, the newest
    assert step == last["step"] == rep["steps_completed"] - 1 and info.path == last["path"]
    assert f"--resume {ckpts}" in output


def test_a_script_that_never_calls_init_is_reported_not_waited_for():
    r = run_job([], nproc=2, script=SCRIPTS / "no_init.py", timeout=120)
    assert r.code == 1, r.output
    assert "exited with code 0 before calling hotspare.init()" in r.output
    assert "did the script run its training?" in r.output
    assert r.report["outcome"] == "stopped"


@pytest.mark.slow
def test_a_spare_killed_while_it_boots_is_replaced_and_the_job_ends_bitwise_equal():
    clean = run_job(ARGS)
    assert clean.code == 0, clean.output
    # w4, the first spare, SIGKILLs itself on its way up; w5 takes its place and then rank 2's.
    r = run_job(ARGS, script=SCRIPTS / "die_booting.py", env={"DIE_BOOTING": "w4"},
                inject=["kill:rank=2:step=20"])
    assert r.code == 0, r.output
    assert "SPARE   w4 was killed by SIGKILL while it started" in r.output
    assert r.digest == clean.digest and r.report["steps_lost"] == 0
    (f,) = r.report["failures"]
    assert f["rank"] == 2 and f["replacement"] == "w5" and f["recovery_path"] == "memory"


@pytest.mark.parametrize("flags, says", [
    (["--hang-floor", "nan"], "not a finite number"),
    (["--join-timeout", "inf"], "not a finite number"),
    (["--checkpoint-seconds", "nan", "--checkpoint-dir", "x"], "not a finite number"),
    (["--telemetry-period", "inf"], "not a finite number"),
    (["--nproc", "100000"], "--oversubscribe"),
    (["--master-port", "70000"], "--master-port"),
    (["--devices", "100000"], "at most 4096"),
    (["--inject", "exit:rank=0:step=3:code=999"], "code=999 is out of range"),
    (["--inject", "kill:rank=0:step=99999999999"], "out of range"),
])
def test_bad_numbers_on_the_command_line_exit_2_with_a_message(flags, says):
    proc = subprocess.run([sys.executable, "-m", "hotspare", "run", *flags, "--", str(EXAMPLE), *ARGS],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert says in proc.stderr, proc.stderr
    assert "START" not in proc.stdout
