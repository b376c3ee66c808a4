"""Ordinary DDP scripts composed, seeded, from the features users combine
(hotspare/testing/scriptgen.py: BatchNorm, dropout, accumulation under no_sync, a scheduler in
or after the block, an EMA, a GAN-like pair, unused parameters, rank-0 evaluation inside and
between steps, job.loader with workers, job.epochs, early stopping, a GradScaler).

The oracle, object by object on every rank (hotspare verify's judge): the fault-free run under
hotspare equals plain torchrun, and a run with one seeded SIGKILL equals the fault-free run, with
nothing lost or repeated and no healthy rank fenced. A failure names the issue-#28 cases the
composition touches (scriptgen.ISSUE_28_CASES): until those are fixed in hotspare/runtime, the
compositions that have them fail, on purpose; nothing here works around them.

    HOTSPARE_GENERATED=20 HOTSPARE_GENERATED_SEED=100 python -m pytest -m slow tests/e2e/test_generated_scripts.py
"""
import os

import pytest

from hotspare.cli.verify import check, render
from hotspare.testing.scriptgen import compose, kill_of, open_cases, write

N = int(os.environ.get("HOTSPARE_GENERATED", "8"))
FIRST = int(os.environ.get("HOTSPARE_GENERATED_SEED", "0"))
COMPOSITIONS = [compose(seed) for seed in range(FIRST, FIRST + N)]
WORLD = 4


@pytest.mark.slow
@pytest.mark.parametrize("comp", COMPOSITIONS, ids=[c.name for c in COMPOSITIONS])
def test_a_generated_script_equals_torchrun_and_a_seeded_kill_equals_the_fault_free_run(comp, tmp_path):
    script = write(comp, tmp_path)
    verdicts, problems = check(str(script), comp.args, WORLD, str(tmp_path / "runs"), faults=kill_of(comp, WORLD),
                               timeout=600)
    # A lost rank's per-rank state that its script changed after the gradient exchange (an EMA
    # updated after the block copies the BatchNorm statistics) is not claimed: the run's report
    # carries a CAVEAT for it. Anything else that differs fails.
    differ = [v for v in verdicts if not v.equal and not v.caveated]
    assert verdicts and not differ and not problems, (
        f"{comp.name}: issue-#28 cases it touches: {open_cases(comp)}\n{render(verdicts, problems)}\n"
        f"script:\n{script.read_text()}")
