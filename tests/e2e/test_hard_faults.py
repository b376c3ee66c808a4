"""Hard faults with real processes and signals, judged by the bitwise oracle: hangs, abrupt
exits, faults during a recovery, every copy lost (checkpoint fallback), resume, no capacity."""
import os
import subprocess
import sys

import pytest

from hotspare.testing.inproc import fault_free, run_inproc
from hotspare.testing.local import EXAMPLE

ARGS = ["--model", "tiny", "--steps", "40"]
FAST = ["--hang-floor", "1"]


@pytest.fixture(scope="module")
def reference():
    r = fault_free(ARGS)
    assert r.code == 0, r.output
    return r.digest


def assert_memory_recovery(r, reference, failures=None):
    assert r.code == 0, r.output
    rep = r.report
    assert rep["final_state_digest"] == reference and rep["steps_repeated"] == 0 and rep["steps_lost"] == 0
    assert all(f["recovery_path"] == "memory" and f["lost_steps"] == 0 for f in rep["failures"])
    if failures is not None:
        assert rep["failures_total"] == failures, rep["failures"]
    assert rep["failures_total"] >= 1
    return rep


def test_hang_is_detected_by_heartbeat_fenced_and_replaced(reference):
    rep = assert_memory_recovery(run_inproc(ARGS, inject=["hang:rank=1:step=11"], extra=FAST), reference, 1)
    f = rep["failures"][0]
    assert f["kind"] == "hang" and f["rank"] == 1
    assert 0.5 < f["detection_latency_s"] < 10       # threshold 1 s: far below any collective timeout


@pytest.mark.slow   # run by .ci/run after the default suite
def test_a_rank_stuck_computing_is_found_by_probing_and_fenced():
    # Not stopped (the kernel shows it running) and not dead: rank 2 computes 100x slower from step
    # 8 on, several seconds a step against a ~1 s threshold (the 1m model, so that the first slow
    # step alone is past it). The stall makes the coordinator probe every rank; rank 2 answers
    # that it never entered the exchange the others wait in, so it alone is fenced.
    args = ["--model", "1m", "--steps", "16"]
    clean = run_inproc(args, extra=FAST)
    assert clean.code == 0, clean.output
    r = run_inproc(args, inject=["slow:rank=2:factor=100:step=8"], extra=FAST)
    rep = assert_memory_recovery(r, clean.digest, 1)
    f = rep["failures"][0]
    assert f["kind"] == "hang" and f["rank"] == 2, f
    assert "never reached the gradient exchange" in r.output


def test_abrupt_exit_with_a_status(reference):
    rep = assert_memory_recovery(run_inproc(ARGS, inject=["exit:rank=2:step=13:code=7"]), reference, 1)
    assert rep["failures"][0]["kind"] == "exit 7"


def test_replacement_killed_while_receiving_the_state(reference):
    r = run_inproc(ARGS, inject=["kill:rank=3:step=9", "kill:rank=3:phase=transfer"])
    rep = assert_memory_recovery(r, reference)
    assert rep["failures"][1]["step"] is None          # it died before running any step


def test_source_killed_while_sending_picks_another_source(reference):
    r = run_inproc(ARGS, inject=["kill:rank=3:step=9", "kill:rank=0:phase=transfer"])
    rep = assert_memory_recovery(r, reference)
    assert rep["failures"][1]["rank"] == 0 and rep["failures"][1]["source_rank"] != 0


def test_survivor_killed_while_the_next_generation_forms(reference):
    r = run_inproc(ARGS, inject=["kill:rank=3:step=9", "kill:rank=1:phase=join:after=9"])
    rep = assert_memory_recovery(r, reference)
    assert rep["failures_total"] >= 2


def test_every_rank_lost_falls_back_to_the_checkpoint_and_says_so(reference, tmp_path):
    kills = [f"kill:rank={r}:step=25" for r in range(4)]
    r = run_inproc(ARGS, inject=kills, extra=["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "10"])
    assert r.code == 0, r.output
    rep = r.report
    assert rep["final_state_digest"] == reference       # recomputed deterministically from the checkpoint
    assert rep["recovered_from_checkpoint"] == 4 and rep["recovered_zero_loss"] == 0
    # Rank 0 starts writing step 20 as it commits it and is killed five steps later; on a loaded
    # machine that write can still be in flight and die with it (then step 10 is the newest
    # durable copy: 14 lost steps, not 4), or start late because step 10's was still being
    # written. The job must restore the newest copy it was told of, say which, and count from it.
    restored = {f["target_step"] for f in rep["failures"]}
    assert len(restored) == 1, rep["failures"]
    (at,) = restored
    first_gen = [c["step"] for c in rep["checkpoints"] if c["generation"] == 1]   # before the fault
    assert at == max(first_gen) and 10 <= at <= 24, rep["checkpoints"]
    assert rep["steps_lost"] == 24 - at
    assert f"falling back to the checkpoint at step {at}" in r.output


def test_resume_from_a_checkpoint_continues_bitwise(reference, tmp_path):
    first = run_inproc(["--model", "tiny", "--steps", "30"], extra=["--checkpoint-dir", str(tmp_path),
                                                                 "--checkpoint-every", "10"])
    assert first.code == 0, first.output
    resumed = run_inproc(ARGS, extra=["--resume", str(tmp_path)])
    assert resumed.code == 0, resumed.output
    assert resumed.digest == reference and "resuming from" in resumed.output


def test_corrupt_checkpoint_is_refused_before_anything_starts(tmp_path):
    r = run_inproc(["--model", "tiny", "--steps", "60"], extra=["--checkpoint-dir", str(tmp_path),
                                                             "--checkpoint-every", "10"])
    assert r.code == 0, r.output
    # Every checkpoint damaged: --resume falls back past a damaged newest one
    # (tests/checkpoint/test_checkpoint_faults.py), so with none valid it must refuse to start.
    # (A checkpoint that falls due while the previous one is still being written waits for the
    # next step after it: which steps got one depends on the disk, not how many at least.)
    steps = sorted(p for p in tmp_path.iterdir() if p.name.startswith("step-"))
    assert len(steps) >= 2, [p.name for p in steps]      # the newest ones are kept
    for step in steps:
        data = next(p for p in step.iterdir() if p.suffix == ".distcp")
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    proc = subprocess.run([sys.executable, "-m", "hotspare", "run", "--nproc", "2", "--resume", str(tmp_path),
                           "--", str(EXAMPLE), "--model", "tiny", "--steps", "20"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "corrupt" in proc.stderr, proc.stderr


@pytest.mark.slow   # run by .ci/run after the default suite
def test_no_capacity_left_stops_cleanly_with_a_usable_checkpoint(tmp_path):
    r = run_inproc(ARGS, nproc=3, spares=0, inject=["kill:rank=1:step=12"],
                extra=["--max-replacements", "0", "--capacity-wait", "1", "--checkpoint-dir", str(tmp_path)])
    assert r.code == 1, r.output
    assert "no capacity left" in r.output and f"--resume {tmp_path}" in r.output
    assert r.report["outcome"] == "stopped"
    resumed = run_inproc(ARGS, nproc=3, spares=0, extra=["--resume", str(tmp_path)])
    assert resumed.code == 0 and "resuming from" in resumed.output


@pytest.mark.slow   # run by .ci/run after the default suite
def test_short_chaos_soak_ends_bitwise_equal_with_zero_lost_steps():
    # Two node agents (the other tests run one): ranks, spares and faults cross agents.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "hotspare", "chaos", "--faults", "8", "--steps", "400",
                           "--seed", "1", "--local-nodes", "2"], capture_output=True, text=True, timeout=600,
                          env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "digest match                 yes" in out and "steps lost                   0" in out
    injected = int(out.split("faults injected")[1].split()[0])
    assert injected >= 8


@pytest.mark.slow   # run by .ci/run after the default suite
def test_a_slow_rank_that_keeps_committing_is_never_fenced():
    from hotspare.testing.local import REPO
    # every step takes 0.8 s, longer than the 0.5 s floor: the threshold follows the measured
    # step time (10 x median), so the slow rank is not taken for a hung one.
    r = run_inproc(["12"], script=REPO / "tests" / "scripts" / "slow.py", extra=["--hang-floor", "0.5"],
                env={"SLOW_RANK": "2", "SLOW_S": "0.8"})
    assert r.code == 0, r.output
    assert r.report["failures_total"] == 0 and "FENCE" not in r.output
