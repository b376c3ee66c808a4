"""An elastic job (`hotspare run --elastic MIN`, a script over job.virtual_ranks) under the
in-process harness, real processes and a real SIGKILL: a lost rank with no spare → the job
shrinks (the survivor runs the lost rank's virtual rank: its micro-batches, generator and data
position) and keeps training; the replacement that starts meanwhile takes the virtual rank back
at a step boundary (regrow). Every step trains the same samples as the fault-free elastic run,
every sample once per epoch, and the run ends bitwise equal to it: the replicated state and
every virtual rank's own state."""
import re
from pathlib import Path

import pytest

from hotspare.testing.inproc import fault_free, run_inproc
from hotspare.testing.elastic import trained, virtual_digests

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "elastic.py"
STEPS = 24
ARGS = [str(STEPS), "0.1"]    # steps of >= 0.1 s: a cold replacement is ready long before the end
SAMPLES, PER_EPOCH = 64, 8    # 2 virtual ranks x 8 batches of 4 per epoch


def test_elastic_kill_with_no_spare_shrinks_keeps_training_and_regrows_bitwise():
    ref = fault_free(ARGS, nproc=2, script=SCRIPT, extra=["--elastic", "1"])
    assert ref.code == 0, ref.output[-4000:]
    r = run_inproc(ARGS, nproc=2, spares=0, script=SCRIPT, extra=["--elastic", "1"], inject=["kill:rank=1:step=5"])
    assert r.code == 0, r.output[-6000:]
    assert re.search(r"SHRINK  generation 2: .*virtual rank\(s\) 1 -> w0", r.output), r.output[-6000:]
    assert re.search(r"REGROW  generation 3: all ranks paused after step \d+", r.output), r.output[-6000:]
    rep = r.report
    assert rep["steps_completed"] == STEPS and rep["steps_repeated"] == 0
    assert rep["failures_total"] == rep["recovered_zero_loss"] == 1 and rep["failures"][0]["lost_steps"] == 0
    assert r.digest == ref.digest, "the shrunk and regrown run diverged from the fault-free elastic run"
    assert virtual_digests(r.output) == virtual_digests(ref.output) and len(virtual_digests(ref.output)) == 2
    samples = trained(ref.output)
    assert trained(r.output) == samples and len(samples) == STEPS * 2
    for epoch in range(STEPS // PER_EPOCH):
        seen = [i for (step, _), idx in samples.items() if step // PER_EPOCH == epoch for i in idx]
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}: a sample trained twice or not at all"


@pytest.mark.slow
def test_elastic_job_with_a_spare_fails_over_as_any_job():
    ref = fault_free(ARGS, nproc=2, script=SCRIPT, extra=["--elastic", "1"])
    r = run_inproc(ARGS, nproc=2, spares=1, script=SCRIPT, extra=["--elastic", "1"], inject=["kill:rank=0:step=7"])
    assert r.code == 0, r.output[-6000:]
    assert "SHRINK" not in r.output and r.report["failures_total"] == 1
    assert r.digest == ref.digest and virtual_digests(r.output) == virtual_digests(ref.output)


@pytest.mark.slow
@pytest.mark.parametrize("kill, extra", [
    ("kill:rank=0:step=5", []),                               # virtual rank 0 moves: rank 0 changes worker
    ("kill:rank=2:step=5", ["--fingerprint-every", "100"]),   # no pause vote before the end: regrown after it
    ("kill:rank=1:step=5,kill:rank=2:step=5", []),            # two lost at once: one rank runs all three
])
def test_three_ranks_shrink_and_regrow_bitwise(kill, extra):
    x = ["--elastic", "1", *extra]
    ref = fault_free(ARGS, nproc=3, script=SCRIPT, extra=x)
    r = run_inproc(ARGS, nproc=3, spares=0, script=SCRIPT, extra=x, inject=kill.split(","))
    assert r.code == 0, r.output[-6000:]
    assert "SHRINK  generation 2" in r.output and "REGROW  generation 3" in r.output, r.output[-6000:]
    assert r.digest == ref.digest and r.report["steps_repeated"] == 0
    assert virtual_digests(r.output) == virtual_digests(ref.output) and len(virtual_digests(ref.output)) == 3
    assert trained(r.output) == trained(ref.output)


def test_elastic_with_a_script_not_over_virtual_ranks_stops_before_the_first_step():
    # a shrink would change such a script's global batch: refused, never run wrongly
    r = run_inproc(["--model", "tiny", "--steps", "4"], nproc=2, spares=0, extra=["--elastic", "1"], timeout=120)
    assert r.code != 0 and "needs a script that trains over job.virtual_ranks" in r.output, r.output[-3000:]
    assert "SHRINK" not in r.output
