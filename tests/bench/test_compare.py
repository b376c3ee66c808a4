"""bench/compare.py: the pure parts (flags, failure schedules, metrics, table).

The benchmark itself launches real jobs for minutes (``--quick`` takes 1.5-3 minutes on two
cores), so it is not run here; the manual smoke command is ``python bench/compare.py --quick``
(see docs/BENCHMARKS.md).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import compare  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["--systems", "hotspare,foo"], "unknown foo"),
    (["--systems", "hotspare", "--kill-ranks", "1"], "--kill-ranks needs --kill-steps or --kill-at"),
    (["--systems", "hotspare", "--kill-steps", "10,400"], "must lie in 0-299"),
    (["--systems", "hotspare", "--kill-steps", "10", "--kill-at", "5"], "not both"),
    (["--systems", "hotspare", "--kill-at", "5,x"], "give seconds from launch"),
    (["--systems", "hotspare", "--kill-steps", "10,20", "--kill-ranks", "1"], "one rank in 0-3 per failure"),
    (["--systems", "hotspare", "--quick", "--replica-only"], "drop --replica-only"),
    (["--systems", "hotspare", "--steps", "0"], "--steps must be at least 1"),
])
def test_bad_flags_are_refused_with_a_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        compare.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_quick_defaults():
    a = compare.parse_args(["--quick", "--systems", "hotspare,ckpt-yd"])
    assert (a.steps, a.failures, a.legacy_every, a.systems) == (40, 1, 20, ["hotspare", "ckpt-yd"])


def test_spread_schedule_puts_one_failure_in_each_slice_and_is_seeded():
    s = compare.spread_schedule(3, 300, step_s=0.1, seed=6)
    assert s == compare.spread_schedule(3, 300, step_s=0.1, seed=6)
    assert s != compare.spread_schedule(3, 300, step_s=0.1, seed=7)
    for i, k in enumerate(s.kills):
        assert 100 * i + 25 <= k.at_step <= 100 * i + 75
        assert 0 <= k.rank < compare.WORLD and 0 <= k.delay_s <= 0.1
    assert s.mtbf_s == pytest.approx(10.0)


def test_renewal_schedule_keeps_its_gaps_until_the_horizon():
    s = compare.renewal_schedule(13.0, 22.0, horizon_s=300.0, seed=7)
    times = [k.at_s for k in s.kills]
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert all(13.0 <= g <= 22.0 for g in gaps) and times[-1] <= 300.0 < times[-1] + 22.0
    assert s.mtbf_s == 17.5


def _run(progress, kills, jct):
    r = compare.Run("checkpoint-restart", "main-ckpt-yd", [], steps=6, ok=True, jct_s=jct)
    r.progress, r.losses = progress, [1.0] * len(progress)
    r.kills = [{"fired": True, "fired_s": t, "job_step": s, "rank": 1} for t, s in kills]
    return r


def test_a_restart_costs_the_stall_and_the_recomputed_steps():
    # steps 0-3 one second apart, killed during step 4, restarted from the checkpoint of step 2
    run = _run([(1, 0), (2, 1), (3, 2), (4, 3), (10, 2), (11, 3), (12, 4), (13, 5)], [(4.5, 3)], jct=13.5)
    assert compare.median_step(run) == 1.0
    assert compare.steps_recomputed(run) == 2                    # steps 2 and 3 again
    assert compare.lost_per_failure(run) == [12 - 4.5 - 1.0]     # kill to step 4, less one step
    row = compare.summarize(run, ideal_step_s=1.0, ref_digest="d", spares=0)
    assert row["wasted_worker_s"] == 4 * 13.5 - 4 * 6 * 1.0
    assert row["equals_fault_free"] is False                    # no digest collected


def test_a_failure_before_the_previous_one_healed_gets_the_time_up_to_it():
    run = _run([(1, 0), (2, 1), (9, 2), (10, 3), (11, 4), (12, 5)], [(2.5, 1), (5.0, 1)], jct=12.5)
    assert compare.lost_per_failure(run) == [2.5, 9 - 5.0 - 1.0]


def test_table_shows_ratios_against_hotspare():
    hs = compare.summarize(_run([(1, 0), (2, 1), (3, 2), (4, 3), (5, 4), (6, 5)], [], 6.0), 1.0, None, 1)
    hs["system"], hs["label"] = "hotspare", "main-hotspare"
    ck = compare.summarize(_run([(1, 0), (2, 1), (3, 2), (4, 3), (5, 4), (6, 5)], [], 12.0), 1.0, None, 0)
    text = compare.table([hs, ck], hs_jct=6.0)
    assert "ckpt-yd" in text and "0.50" in text
    assert compare._ratios([hs, ck]) == (6.0, {"ckpt-yd": 0.5})


@pytest.mark.parametrize("argv, runs", [
    (["--systems", "hotspare,ckpt-legacy,ckpt-yd"], 2 + 3 + 1 + 2),   # references, systems; replica probe, systems
    (["--quick", "--systems", "hotspare,ckpt-legacy"], 2 + 2),
    (["--quick", "--systems", "ckpt-yd"], 1 + 1 + 1),         # plain reference, the cost probe, ckpt-yd
    (["--quick", "--systems", "ckpt-yd", "--yd-every", "5"], 1 + 1),
    (["--replica-only", "--systems", "hotspare,ckpt-yd"], 1 + 1),
])
def test_the_progress_line_counts_the_jobs_it_will_start(argv, runs):
    assert compare.planned_runs(compare.parse_args(argv)) == runs
