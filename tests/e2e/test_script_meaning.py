"""An ordinary script keeps its meaning under hotspare: a spare is invisible to it until it takes
a rank (then it sees that rank, the world size and the process group, as under torchrun); an
unused spare runs none of its code past init(); its atexit handlers run; mistakes in what it
tells hotspare are clear errors, not hardware verdicts."""
import os

import pytest

from hotspare.testing.inproc import run_inproc
from hotspare.testing.local import REPO

SCRIPT = REPO / "tests" / "scripts" / "meaning.py"


def files(d, prefix):
    return sorted(n.split("-", 2)[-1] for n in os.listdir(d) if n.startswith(prefix))


@pytest.mark.parametrize("spawn", ["fork", pytest.param("exec", marks=pytest.mark.slow)])
def test_an_unused_spare_runs_no_code_past_init_and_atexit_handlers_run(tmp_path, spawn):
    r = run_inproc([str(tmp_path), "12"], nproc=2, spares=1, script=SCRIPT, extra=["--spawn", spawn])
    assert r.code == 0, r.output
    assert files(tmp_path, "after-init-") == ["w0", "w1"], "the spare ran the script past init()"
    assert files(tmp_path, "after-loop-") == ["w0", "w1"]
    assert files(tmp_path, "atexit-") == ["w0", "w1", "w2"], "a worker skipped the script's atexit handlers"
    assert [(tmp_path / f"after-init-w{i}").read_text() for i in (0, 1)] == ["0 2 0 2", "1 2 1 2"]
    assert "exited with code" not in r.output, r.output


def test_a_replacement_sees_its_rank_world_size_and_process_group_after_init(tmp_path):
    r = run_inproc([str(tmp_path), "12"], nproc=2, spares=1, script=SCRIPT, inject=["kill:rank=1:step=5"])
    assert r.code == 0 and r.report["recovered_zero_loss"] == 1, r.output
    assert (tmp_path / "after-init-w2").read_text() == "1 2 1 2"
    assert files(tmp_path, "after-loop-") == ["w0", "w2"]


@pytest.mark.slow   # run by .ci/run after the default suite (the default suite's budget: README)
def test_atexit_handlers_run_under_plain_torchrun(tmp_path):
    from hotspare.testing.local import run_torchrun
    proc, _ = run_torchrun([str(tmp_path), "6"], SCRIPT, nproc=2, stats_flag=None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert files(tmp_path, "atexit-") == ["rank0", "rank1"]


def test_an_untracked_scheduler_is_a_clear_error_before_the_first_step(tmp_path):
    r = run_inproc([str(tmp_path), "12", "untracked-scheduler"], nproc=2, spares=1, script=SCRIPT)
    assert r.code != 0
    assert "StepLR on the tracked optimizer is not tracked" in r.output and "job.track(scheduler=" in r.output
    assert not r.report["health_events"], "a script's mistake must not reach the health service"


def test_ranks_that_disagree_on_the_number_of_steps_stop_with_a_clear_error(tmp_path):
    r = run_inproc([str(tmp_path), "12", "rank-dependent-total"], nproc=2, spares=1, script=SCRIPT, timeout=120)
    assert r.code == 1, r.output
    assert "ranks disagree on job.steps(total)" in r.output


def test_state_the_script_did_not_track_is_named_a_script_bug_after_a_failover_not_a_hardware_fault():
    r = run_inproc(["20"], nproc=3, spares=1, script=REPO / "tests" / "scripts" / "untracked_counter.py",
                inject=["kill:rank=1:step=5"])
    assert r.code == 1, r.output
    assert "StateTrackingError" in r.output and "Pass it to job.track" in r.output
    assert not r.report["health_events"], "no device may be cordoned for a script's bug"


@pytest.mark.slow   # run by .ci/run after the default suite (the default suite's budget: README)
def test_launcher_ends_with_a_report_when_a_rank_dies_after_its_peers_finished():
    # Rank 0 alone calls a collective after some steps (a script bug): it is fenced as hung each
    # time, and after the last step it dies while rank 1 has already finished and waits to be
    # released. The finished rank counts as a survivor that reported: the job ends, with a report.
    r = run_inproc(["10"], nproc=2, spares=1, script=REPO / "tests" / "scripts" / "rank0_collective.py",
                timeout=150)
    assert r.report is not None, r.output
    assert r.code == 0 and r.report["steps_completed"] == 10 and r.report["outcome"] == "finished", r.output
