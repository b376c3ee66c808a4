"""Closed forms: the seed numbers, the published presets, and the identities the models rest on."""
import dataclasses
import math

import pytest

from hotspare.errors import ConfigError
from hotspare.sim import failure_math as fm
from hotspare.sim.economics import MAX_INTERVAL_H, PlanInputs, drivers, evaluate
from hotspare.sim.presets import DEFAULT_MIX, PRESETS, mix_mean, shares
from hotspare.sim.stats import mean_ci, t_quantile
from hotspare.sim.units import parse_duration, parse_fraction


# --- the numbers the issue pins -------------------------------------------------------------

def test_one_percent_afr_for_a_month():
    assert fm.p_at_least_one(0.01, 256, 30) == pytest.approx(0.19, abs=0.005)
    assert fm.p_at_least_one(0.01, 1024, 30) == pytest.approx(0.57, abs=0.005)
    assert fm.p_at_least_one(0.01, 1024, 30) == pytest.approx(1 - math.exp(-0.01 * 1024 * 30 / 365))


def test_presets_reproduce_their_sources():
    llama = PRESETS["llama3-405b"]
    assert fm.expected_failures(llama.per_gpu_year, 16_384, 54) == pytest.approx(419)
    assert 1 / fm.failures_per_hour(llama.per_gpu_year, 16_384) == pytest.approx(54 * 24 / 419)
    rsc1 = PRESETS["meta-rsc1"]
    node_days = 1000
    assert fm.expected_failures(rsc1.per_gpu_year, 8, node_days) == pytest.approx(6.5)
    assert PRESETS["afr-1pct"].per_gpu_year == 0.01


def test_default_mix_is_llama3_table_5():
    assert sum(k.weight for k in DEFAULT_MIX) == 419
    assert sum(shares(DEFAULT_MIX)) == pytest.approx(1.0)
    assert mix_mean(DEFAULT_MIX, "destroys_state") == pytest.approx((6 + 0.25 * 56) / 419)


# --- optimal intervals --------------------------------------------------------------------------

def _numeric_best(lam, stall, restart):
    lo, hi = stall / 100, 50.0 / lam
    for _ in range(200):   # golden-section search on a unimodal goodput
        a, b = lo + (hi - lo) * 0.382, lo + (hi - lo) * 0.618
        if fm.checkpoint_goodput(lam, a, stall, restart) < fm.checkpoint_goodput(lam, b, stall, restart):
            lo = a
        else:
            hi = b
    return (lo + hi) / 2


@pytest.mark.parametrize("mtbf,stall", [(100.0, 0.05), (3.0, 2 / 60), (1.0, 0.1), (0.5, 0.2)])
def test_daly_is_near_optimal_and_better_than_young(mtbf, stall):
    lam, restart = 1 / mtbf, 0.5
    best = fm.checkpoint_goodput(lam, _numeric_best(lam, stall, restart), stall, restart)
    daly = fm.checkpoint_goodput(lam, fm.daly_interval(stall, mtbf), stall, restart)
    young = fm.checkpoint_goodput(lam, fm.young_interval(stall, mtbf), stall, restart)
    assert best - daly < 2e-3
    assert daly >= young - 1e-12


def test_daly_falls_back_to_mtbf_when_checkpoints_are_huge():
    assert fm.daly_interval(3.0, 1.0) == 1.0
    assert fm.young_interval(0.02, 100) == pytest.approx(2.0)


# --- goodput forms -----------------------------------------------------------------------------

def test_checkpoint_goodput_is_dalys_expected_wall_time():
    lam, tau, c, r = 0.3, 1.2, 0.05, 0.5
    m = 1 / lam
    wall_per_work = m * math.exp(r / m) * (math.exp((tau + c) / m) - 1) / tau   # Daly 2006
    assert fm.checkpoint_goodput(lam, tau, c, r) == pytest.approx(1 / wall_per_work)
    assert fm.checkpoint_goodput(0.0, tau, c, r) == pytest.approx(tau / (tau + c))


def test_live_goodput_reduces_to_checkpoint_restart_when_every_failure_falls_back():
    lam, tau, c, r = 0.3, 1.2, 0.05, 0.5
    assert fm.live_goodput(lam, 1.0, 0.1, 0.01, tau, c, r, 0.0) == pytest.approx(
        fm.checkpoint_goodput(lam, tau, c, r), rel=1e-12)


@pytest.mark.parametrize("lam", [1e-3, 1e-2])
def test_live_goodput_matches_the_first_order_form_when_failures_are_rare(lam):
    pf, d, step, tau, c, r, o = 0.05, 2 / 60, 10 / 3600, 6.0, 2 / 60, 0.5, 0.01
    first_order = o + c / tau + lam * ((1 - pf) * (d + step / 2) + pf * (r + tau / 2))
    exact = 1 - fm.live_goodput(lam, pf, d, step, tau, c, r, o)
    assert exact == pytest.approx(first_order, rel=0.05)


def test_live_goodput_is_continuous_at_zero_fallback():
    args = (0.5, None, 0.05, 0.003, 4.0, 0.03, 0.5, 0.01)
    at = lambda pf: fm.live_goodput(args[0], pf, *args[2:])   # noqa: E731
    assert at(1e-12) == pytest.approx(at(0.0), rel=1e-9)
    assert at(0.0) == pytest.approx(0.99 * (1 - 0.5 * 0.003 / 2) * 4.0 / (4.03 * math.exp(0.5 * 0.05)))


# --- spares ------------------------------------------------------------------------------------

def test_erlang_b_known_values_and_spares_needed():
    assert fm.erlang_b(2.0, 1) == pytest.approx(2 / 3)
    assert fm.erlang_b(1.0, 2) == pytest.approx(0.2)
    n = fm.spares_needed(0.5, 20.0, 0.01)        # offered load 10 nodes
    assert fm.pool_empty_probability(0.5, 20.0, n) <= 0.01 < fm.pool_empty_probability(0.5, 20.0, n - 1)


# --- economics -----------------------------------------------------------------------------------

def test_break_even_overhead_zeroes_the_saving():
    plan = evaluate(PlanInputs(gpus=2048, afr=PRESETS["meta-rsc1"].per_gpu_year))
    assert plan.net_saving_usd_year > 0
    at_break_even = evaluate(dataclasses.replace(plan.inputs, overhead=plan.break_even_overhead, spares=plan.spares))
    assert at_break_even.net_saving_usd_year == pytest.approx(0.0, abs=1.0)


def test_low_failure_rates_do_not_pay():
    """The honest case: at a 1% AFR on 1,024 GPUs a tuned checkpoint setup wins."""
    plan = evaluate(PlanInputs(gpus=1024, afr=0.01))
    assert plan.net_saving_usd_year < 0 and plan.break_even_overhead < 0


def test_optimal_intervals_are_capped_at_a_day():
    plan = evaluate(PlanInputs(gpus=64, afr=0.01))
    assert plan.checkpoint.interval == MAX_INTERVAL_H and "capped" in plan.checkpoint.interval_rule


def test_wasted_money_is_consistent():
    plan = evaluate(PlanInputs(gpus=1000, days=10, price=2.0))
    cr = plan.checkpoint
    assert cr.wasted_gpu_hours_run == pytest.approx((1 - cr.goodput) * 1000 * 240)
    assert cr.wasted_usd_year == pytest.approx(cr.wasted_gpu_hours_year * 2.0)


def test_drivers_rank_by_swing():
    drv = drivers(PlanInputs(gpus=2048, interval=2.0))
    assert [d.swing for d in drv] == sorted((d.swing for d in drv), reverse=True)
    assert {"afr", "restart", "interval"} <= {d.name for d in drv}


@pytest.mark.parametrize("change,needle", [
    ({"gpus": 0}, "gpus"),
    ({"afr": -0.01}, "afr"),
    ({"days": 0}, "days"),
    ({"interval": 1 / 60}, "longer than the checkpoint stall"),
    ({"overhead": 1.5}, "overhead"),
    ({"fallback": 2.0}, "fallback"),
    ({"spares": -1}, "spares"),
])
def test_impossible_inputs_are_rejected(change, needle):
    with pytest.raises(ConfigError, match=needle):
        evaluate(PlanInputs(**{"gpus": 8, **change}))


# --- helpers -----------------------------------------------------------------------------------

def test_units():
    assert parse_duration("90s", "x") == pytest.approx(0.025)
    assert parse_duration("2m", "x") == pytest.approx(1 / 30)
    assert parse_duration("1.5h", "x") == 1.5
    assert parse_duration("3d", "x") == 72
    assert parse_fraction("1%", "x") == pytest.approx(0.01)
    assert parse_fraction("0.17", "x") == 0.17
    with pytest.raises(ConfigError, match="unit"):
        parse_duration("30", "--restart")


def test_student_t_interval():
    assert t_quantile(0.975, 19) == pytest.approx(2.093, abs=1e-3)
    assert t_quantile(0.975, 1) == pytest.approx(12.706, abs=1e-3)
    mean, half = mean_ci([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5 and half == pytest.approx(3.182 * math.sqrt(5 / 3) / 2, rel=2e-3)
