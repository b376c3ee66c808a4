"""Ordinary DDP scripts, not the example GPT, under real faults (examples/cnn_loader.py,
mlp_accum.py, amp_text.py, buffers_dropout.py): a DataLoader with a DistributedSampler, workers
and augmentations; BatchNorm; accumulation under no_sync with zero_grad at the end; a GradScaler
under bf16 autocast; buffers of a model's own; per-rank generators; rank-0 evaluations.

The oracle, on every rank: the replicated digest (parameters, optimizer, scheduler, scaler) AND
each rank's per-rank digest (generators, buffers, data position) equal those of the same run
without the fault, and of the same script under plain torchrun; no step lost, none repeated."""
import pytest

from hotspare.testing.inproc import run_inproc
from hotspare.testing.local import ORDINARY_SCRIPTS, REPO, run_torchrun

EXAMPLES = REPO / "examples"
SCRIPTS = ORDINARY_SCRIPTS
_references: dict[str, dict] = {}


def reference(name: str) -> dict:
    if name not in _references:
        args, steps = SCRIPTS[name]
        r = run_inproc(args, script=EXAMPLES / f"{name}.py")
        assert r.code == 0, r.output
        assert r.report["failures_total"] == 0 and r.report["replicas_consistent"], r.output
        assert r.report["steps_completed"] == steps and len(r.report["rank_digests"]) == 4
        _references[name] = r.report
    return _references[name]


def run_with(name: str, inject: list[str], extra: list[str] = ()) -> dict:
    args, steps = SCRIPTS[name]
    r = run_inproc(args, script=EXAMPLES / f"{name}.py", inject=inject, extra=extra)
    ref = reference(name)
    assert r.code == 0, r.output
    rep = r.report
    assert rep["final_state_digest"] == ref["final_state_digest"], "replicated state diverged\n" + r.output
    differ = [k for k in ref["rank_digests"] if rep["rank_digests"].get(k) != ref["rank_digests"][k]]
    assert not differ, f"per-rank state of ranks {differ} diverged\n" + r.output
    assert rep["steps_completed"] == steps and rep["steps_repeated"] == 0
    assert rep["failures_total"] >= 1 and rep["recovered_zero_loss"] == rep["failures_total"], r.output
    assert all(f["lost_steps"] == 0 and f["recovery_path"] == "memory" for f in rep["failures"])
    return rep


@pytest.mark.parametrize("name", ["cnn_loader", pytest.param("mlp_accum", marks=pytest.mark.slow),
                                  pytest.param("amp_text", marks=pytest.mark.slow),
                                  pytest.param("buffers_dropout", marks=pytest.mark.slow)])
def test_rank_0_killed_mid_run_every_rank_ends_bitwise_equal(name):
    # Rank 0's per-rank state matters to everyone: DDP broadcasts its buffers at each forward.
    run_with(name, ["kill:rank=0:step=9"])


@pytest.mark.parametrize("name", [pytest.param("amp_text", marks=pytest.mark.slow)])
def test_same_script_under_plain_torchrun_gives_the_same_digests(name):
    args, _ = SCRIPTS[name]
    proc, stats = run_torchrun(args, EXAMPLES / f"{name}.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ref = reference(name)
    assert [s["digest"] for s in stats] == [ref["final_state_digest"]] * 4
    assert {str(r): s["rank_digest"] for r, s in enumerate(stats)} == ref["rank_digests"]
    printed = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(printed) <= 3, "job.log prints at most every 10 s outside hotspare run"


def test_loader_rank_killed_at_the_last_step_of_an_epoch_and_at_the_first_of_the_next():
    # The first step of an epoch makes the epoch's iterator (a draw from torch's generator).
    run_with("cnn_loader", ["kill:rank=2:step=7"])
    run_with("cnn_loader", ["kill:rank=1:step=8"])


def test_accumulation_with_zero_grad_at_the_end_killed_at_the_first_and_the_last_step():
    # The survivors hold the failed step's accumulated gradients: a re-run must not add to them.
    run_with("mlp_accum", ["kill:rank=1:step=0"])
    run_with("mlp_accum", ["kill:rank=3:step=23"])


def test_two_ranks_killed_in_the_same_step_of_a_scaler_script():
    run_with("amp_text", ["kill:rank=0:step=12", "kill:rank=3:step=12"])


def test_hang_of_a_rank_with_its_own_buffers_and_generators():
    run_with("buffers_dropout", ["hang:rank=1:step=14"])


# The rest of the matrix: every script, every fault.
MATRIX = [["kill:rank=2:step=12"], ["kill:rank=1:step=0"], ["kill:rank=3:step=15"],
          ["kill:rank=0:step=6", "kill:rank=2:step=6"], ["hang:rank=2:step=11"], ["exit:rank=1:step=5"]]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCRIPTS))
@pytest.mark.parametrize("inject", MATRIX, ids=["+".join(m) for m in MATRIX])
def test_matrix_of_faults_on_every_ordinary_script(name, inject):
    run_with(name, inject)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cnn_loader", "mlp_accum", "buffers_dropout"])
def test_the_other_scripts_under_plain_torchrun(name):
    test_same_script_under_plain_torchrun_gives_the_same_digests(name)


@pytest.mark.slow
def test_accumulation_with_zero_grad_set_to_none_false_and_without_no_sync():
    for extra in (["--set-to-none", "0"], ["--accum", "1"]):
        args = SCRIPTS["mlp_accum"][0] + extra
        ref = run_inproc(args, script=EXAMPLES / "mlp_accum.py")
        r = run_inproc(args, script=EXAMPLES / "mlp_accum.py", inject=["kill:rank=2:step=10"])
        assert r.code == 0 and r.report["final_state_digest"] == ref.report["final_state_digest"], r.output
        assert r.report["rank_digests"] == ref.report["rank_digests"]
