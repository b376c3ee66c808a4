"""The step contract on the shapes ordinary scripts take (tests/scripts/shapes.py), each case of
issue #28 as a fault: rank-0 evaluations inside the step, at the top of the loop and after the
block (they draw from torch's generator: iterating a DataLoader does); a scheduler and an EMA
stepped after the block; DDP(find_unused_parameters=True) with a branch only some ranks take;
an early-stopping `break`. The oracle, on every rank: fault-free equal to plain torchrun; a kill
equal to fault-free; where hotspare cannot vouch for a rank's state, the report says so."""
import pytest

from hotspare.testing.inproc import run_inproc
from hotspare.testing.local import REPO, run_torchrun

SCRIPT = REPO / "tests" / "scripts" / "shapes.py"
ALL = ["--eval-inside", "5", "--eval-between", "7", "--sched-after", "--unused", "--stop-at", "14"]
_refs: dict[tuple, dict] = {}


def fault_free(args: list[str]) -> dict:
    key = tuple(args)
    if key not in _refs:
        r = run_inproc(args, script=SCRIPT)
        assert r.code == 0, r.output
        assert r.report["failures_total"] == 0 and r.report["replicas_consistent"], r.output
        _refs[key] = r.report
    return _refs[key]


def with_faults(args: list[str], inject: list[str]) -> tuple[dict, str]:
    r = run_inproc(args, script=SCRIPT, inject=inject)
    assert r.code == 0, r.output
    rep = r.report
    assert rep["failures_total"] >= 1 and rep["steps_repeated"] == 0, r.output
    assert all(f["lost_steps"] == 0 and f["recovery_path"] == "memory" for f in rep["failures"]), r.output
    return rep, r.output


def assert_equal(rep: dict, ref: dict, output: str) -> None:
    assert rep["final_state_digest"] == ref["final_state_digest"], "replicated state diverged\n" + output
    differ = [k for k in ref["rank_digests"] if rep["rank_digests"].get(k) != ref["rank_digests"][k]]
    assert not differ, f"per-rank state of ranks {differ} diverged\n" + output
    assert rep["steps_completed"] == ref["steps_completed"]


def test_every_shape_at_once_fault_free_equals_plain_torchrun_on_every_rank():
    ref = fault_free(ALL)
    assert ref["steps_completed"] == 15, "the script stopped early after step 14"
    proc, stats = run_torchrun(ALL, SCRIPT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [s["digest"] for s in stats] == [ref["final_state_digest"]] * 4
    assert {str(r): s["rank_digest"] for r, s in enumerate(stats)} == ref["rank_digests"]
    # rank 0's evaluations changed its generator after the exchange: noticed, said, not fenced
    assert ref["changed_after_exchange"].keys() == {"0"} and "rng/torch" in ref["changed_after_exchange"]["0"]["parts"]


def test_every_shape_at_once_rank_2_killed_ends_bitwise_equal():
    rep, out = with_faults(ALL, ["kill:rank=2:step=6"])
    assert_equal(rep, fault_free(ALL), out)
    assert rep["failures_total"] == 1, "a healthy rank was fenced\n" + out
    assert rep["caveats"] == [], "only a lost rank that changed its state after the exchange has a caveat"


@pytest.mark.slow
@pytest.mark.parametrize("rank,step", [(1, 6), (3, 0), (2, 13)])
def test_scheduler_after_the_block_is_undone_for_the_failed_attempt(rank, step):
    # sched.step() after `with step:` runs for the failed attempt too: undone at the top of
    # the next iteration, so it runs once per committed step.
    args = ["--sched-after", "--stop-at", "14"]
    rep, out = with_faults(args, [f"kill:rank={rank}:step={step}"])
    assert_equal(rep, fault_free(args), out)


@pytest.mark.slow
def test_ema_updated_after_the_block_survivors_exact_the_lost_rank_reported():
    # An AveragedModel copies the model's BatchNorm statistics (per-rank) and counts its
    # updates: after the exchange, on every rank. The replicated state ends equal; the lost
    # rank's EMA buffers cannot be received, and the report says so instead of claiming them.
    args = ["--ema", "--stop-at", "14"]
    ref = fault_free(args)
    rep, out = with_faults(args, ["kill:rank=1:step=6"])
    assert rep["final_state_digest"] == ref["final_state_digest"], out
    assert [c["rank"] for c in rep["caveats"]] == [1], out
    assert all(rep["rank_digests"][k] == ref["rank_digests"][k] for k in ("0", "2", "3")), out


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 2])
def test_rank_0_evaluation_at_the_top_of_the_loop_killed_in_that_step_is_exact(rank):
    # A replacement of rank 0 runs the evaluation again; a surviving rank 0 is put back to the
    # top of the iteration and runs it again: every rank exact, nothing to caveat.
    args = ["--eval-top", "5"]
    rep, out = with_faults(args, [f"kill:rank={rank}:step=5"])
    assert_equal(rep, fault_free(args), out)
    assert rep["caveats"] == [] and rep["changed_after_exchange"] == {}, out


@pytest.mark.slow
def test_rank_0_evaluation_after_the_block_then_rank_0_lost_is_reported_not_claimed():
    # Rank 0 draws from its generator after step 7's exchange, and dies before its next one:
    # nobody holds what it drew. The run goes on; the report must not vouch for it.
    args = ["--eval-between", "7"]
    r = run_inproc(args, script=SCRIPT, inject=["kill:rank=0:step=8"])
    assert r.code == 0, r.output
    caveats = r.report["caveats"]
    assert [c["rank"] for c in caveats] == [0], r.output
    assert "CAVEAT" in r.output and "top of the loop body" in caveats[0]["detail"]


@pytest.mark.slow
def test_find_unused_parameters_with_a_branch_some_ranks_take_equals_torchrun_and_survives_a_kill():
    args = ["--unused"]
    ref = fault_free(args)
    proc, stats = run_torchrun(args, SCRIPT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [s["digest"] for s in stats] == [ref["final_state_digest"]] * 4
    rep, out = with_faults(args, ["kill:rank=3:step=4"])
    assert_equal(rep, ref, out)


@pytest.mark.slow
def test_early_stopping_break_finishes_the_job_and_survives_a_kill():
    args = ["--stop-at", "11"]
    ref = fault_free(args)
    assert ref["steps_completed"] == 12 and ref["outcome"] == "finished"
    rep, out = with_faults(args, ["kill:rank=2:step=5"])
    assert_equal(rep, ref, out)


@pytest.mark.slow
def test_a_break_after_a_failed_attempt_of_the_stop_step_stops_clearly():
    # The script's `break` after the block runs for the failed attempt of step 11: the
    # replacement would re-run step 11, the survivors cannot. A clear stop, never a wrong end.
    r = run_inproc(["--stop-at", "11"], script=SCRIPT, inject=["kill:rank=2:step=11"])
    assert r.code != 0, r.output
    assert "early-stopping `break` ran for an attempt that was never committed" in r.output, r.output


def test_an_untracked_ema_and_a_raw_dataloader_are_clear_errors_before_any_failover():
    # Nothing fails here: the script itself breaks the contract, and says how to fix it.
    r = run_inproc(["--ema-untracked"], script=SCRIPT, spares=0)
    assert r.code != 0 and "AveragedModel" in r.output and "is not tracked" in r.output, r.output
    assert "pass it to job.track" in r.output
    r = run_inproc(["--raw-loader"], script=SCRIPT, spares=0)
    assert r.code != 0 and "without job.loader" in r.output and "job.loader(DataLoader" in r.output, r.output
