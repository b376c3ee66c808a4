"""Borrowed spares and shrinking: the per-failure model, its closed form, and the simulator that
replays it failure by failure (the closed-form agreement itself is in test_fleet's validation)."""
import pytest

from hotspare.errors import ConfigError
from hotspare.sim import pool
from hotspare.sim.clock import shrink_clock
from hotspare.sim.economics import PlanInputs, cheapest, evaluate
from hotspare.sim.fleet import FleetConfig, simulate
from hotspare.sim.presets import FailureKind

H = 1 / 3600


def one_kind(destroys=0.0, repair_h=24.0, correlated=0.0):
    return (FailureKind("x", 1.0, 0.0, repair_h, correlated, destroys, "test"),)


# --- what one failure costs ---------------------------------------------------------------------

def test_borrowing_waits_for_the_lender_dedicated_and_shrink_do_not():
    times = dict(downtime=120 * H, lend_pause=30 * H, cold_start=900 * H)
    assert pool.delay("dedicated", "memory", **times) == pytest.approx(120 * H)
    assert pool.delay("borrow", "memory", **times) == pytest.approx(150 * H)
    assert pool.delay("shrink", "memory", **times) == pytest.approx(120 * H)
    assert pool.delay("borrow", "wait", **times) == pytest.approx(1020 * H)
    assert pool.expected_delay("borrow", 0.25, **times) == pytest.approx(0.75 * 150 * H + 0.25 * 1020 * H)
    with pytest.raises(ValueError):
        pool.delay("borrow", "checkpoint", **times)


def test_a_pausing_lender_loses_all_its_nodes_an_elastic_one_only_the_loan():
    common = dict(gpus_per_node=8, lend_pause=0.01, lend_resume=0.1)
    paused = pool.lender_gpu_hours(2, 10.0, lender_nodes=4, lender="pause", **common)
    assert paused == pytest.approx(2 * 8 * 4 * (0.01 + 10.0 + 0.1))
    elastic = pool.lender_gpu_hours(2, 10.0, lender_nodes=4, lender="shrink", **common)
    assert elastic == pytest.approx(2 * 8 * (10.0 + 4 * 0.11))
    assert pool.lender_gpu_hours(1, 10.0, lender_nodes=1, lender="pause", **common) == pytest.approx(
        pool.lender_gpu_hours(1, 10.0, lender_nodes=1, lender="shrink", **common))
    with pytest.raises(ValueError, match="lender"):
        pool.lender_gpu_hours(1, 1.0, lender_nodes=1, lender="evict", **common)


def test_degraded_share_and_copies():
    assert pool.copies(256, 16) == 16 and pool.copies(256, 1) == 256
    assert pool.degraded_share(0.0, 16) == 0.0
    assert pool.degraded_share(1.0, 1) == pytest.approx(1 - 0.36787944)
    assert pool.degraded_share(1.86, 16) > 15 * pool.degraded_share(1.86, 256)   # smaller copies pay less
    assert pool.lendable_nodes(0.1, 256) == 25 and pool.lendable_nodes(0.0, 256) == 0


# --- the shrinking job's clock ------------------------------------------------------------------

def test_shrink_clock_slows_while_a_copy_is_down_and_stops_to_regrow():
    # 4 copies of one node each; node 0 fails at 10 h for 5 h; taking it back stops the job 1 h.
    clock = shrink_clock([10.0], [5.0], [(0,)], lambda n: n, 4, 1.0, horizon=20.0)
    assert clock(10.0) == pytest.approx(10.0)
    assert clock(15.0) == pytest.approx(10.0 + 5 * 0.75)
    assert clock(16.0) == pytest.approx(clock(15.0))            # regrow stop
    assert clock(20.0) == pytest.approx(13.75 + 4.0)
    assert clock.degraded == pytest.approx(5 * 0.25 / 20.0)


def test_shrink_clock_merges_failures_of_the_same_copy():
    # Two nodes of copy 0 (copy_of = n // 2) overlap: the copy is down 10..18, one regrow stop.
    clock = shrink_clock([10.0, 12.0], [5.0, 6.0], [(0,), (1,)], lambda n: n // 2, 2, 1.0, horizon=30.0)
    assert clock(18.0) == pytest.approx(10.0 + 8 * 0.5)
    assert clock(30.0) == pytest.approx(14.0 + 11.0)
    assert clock.degraded == pytest.approx(8 * 0.5 / 30.0)


# --- closed form ------------------------------------------------------------------------------

def test_borrowing_costs_the_lenders_instead_of_idle_spares():
    plan = evaluate(PlanInputs(gpus=2048))
    bw = plan.borrowed
    assert bw.lendable == 25 and bw.no_lender < 1e-6
    assert bw.outcome.goodput < plan.hotspare.goodput           # the lender's pause, every time
    assert bw.net_saving_usd_year == pytest.approx(
        plan.checkpoint.wasted_usd_year - bw.outcome.wasted_usd_year - bw.lender_cost_usd_year)
    cheap = evaluate(PlanInputs(gpus=2048, lender_value=0.5)).borrowed
    assert cheap.lender_cost_usd_year == pytest.approx(bw.lender_cost_usd_year / 2)


def test_nothing_to_borrow_means_waiting_for_cold_nodes():
    none = evaluate(PlanInputs(gpus=2048, lendable_share=0.0)).borrowed
    assert none.no_lender == 1.0 and none.lender_gpu_hours_year == 0.0
    some = evaluate(PlanInputs(gpus=2048)).borrowed
    assert none.outcome.goodput < some.outcome.goodput


def test_shrink_needs_two_copies_and_pays_when_copies_are_small():
    assert evaluate(PlanInputs(gpus=128, replica_nodes=16)).shrunk is None
    big_copies = evaluate(PlanInputs(gpus=16384, replica_nodes=16)).shrunk
    node_copies = evaluate(PlanInputs(gpus=16384, replica_nodes=1)).shrunk
    assert node_copies.degraded < big_copies.degraded / 10
    assert node_copies.net_saving_usd_year > big_copies.net_saving_usd_year > 0


def test_cheapest_picks_the_largest_saving_and_checkpoint_when_none_pays():
    plan = evaluate(PlanInputs(gpus=2048))
    name, saving = cheapest(plan)
    assert saving == max(plan.net_saving_usd_year, plan.borrowed.net_saving_usd_year,
                         plan.shrunk.net_saving_usd_year, 0.0)
    assert cheapest(evaluate(PlanInputs(gpus=64, afr=0.01, lendable_share=0.0)))[0] == "checkpoint-restart"


@pytest.mark.parametrize("change,needle", [
    ({"lendable_share": -0.1}, "lendable"),
    ({"lender": "evict"}, "lender must be one of"),
    ({"lender_nodes": 0}, "lender-nodes"),
    ({"replica_nodes": 0}, "replica-nodes"),
    ({"lend_pause": -1.0}, "lend-pause"),
])
def test_impossible_pool_inputs_are_rejected(change, needle):
    with pytest.raises(ConfigError, match=needle):
        evaluate(PlanInputs(gpus=2048, **change))


# --- simulator --------------------------------------------------------------------------------

def test_borrowing_with_no_pause_replays_exactly_like_dedicated_spares():
    """Same trace, a pool that never runs dry either way, lender pause 0: the two live policies
    differ only in who pays for the replacement."""
    cfg = FleetConfig(gpus=1024, days=90, afr=0.5, mix=one_kind(destroys=0.05), spares=1000,
                      lendable_share=8.0, lend_pause=0.0)
    result = simulate(cfg, seeds=3)
    assert [r.goodput for r in result.borrow] == [r.goodput for r in result.hotspare]
    assert all(r.lender_gpu_hours > 0 for r in result.borrow)


def test_simulated_lender_loss_matches_the_closed_form():
    result = simulate(FleetConfig(gpus=2048, days=365), seeds=20)
    lent = result.summary()["borrow"]["lender_gpu_hours_year"]
    assert 0 < lent["ci"] < 0.1 * lent["mean"]
    assert abs(lent["mean"] - result.plan.borrowed.lender_gpu_hours_year) <= lent["ci"]


def test_an_empty_lendable_pool_sends_every_failure_to_a_cold_node():
    result = simulate(FleetConfig(gpus=1024, days=60, afr=0.3, mix=one_kind(), lendable_share=0.0),
                      seeds=3)
    assert set(result.summary()["borrow"]["paths"]) == {"wait"}
    assert all(r.lender_gpu_hours == 0.0 for r in result.borrow)


def test_shrink_is_left_out_with_one_copy_and_its_degraded_share_is_measured():
    one = simulate(FleetConfig(gpus=128, days=30, replica_nodes=16), seeds=2)
    assert not one.shrink and "shrink" not in one.summary()
    many = simulate(FleetConfig(gpus=2048, days=365, afr=0.5, mix=one_kind(), replica_nodes=1), seeds=5)
    degraded = many.summary()["shrink"]["degraded"]
    assert degraded["mean"] > 0
    assert abs(degraded["mean"] - many.plan.shrunk.degraded) <= max(degraded["ci"], 0.05 * degraded["mean"])


def test_kept_state_exposure_leaves_out_failures_that_destroy_state():
    from hotspare.sim.presets import kept_state_exposure, node_hours_per_failure, nodes_per_failure
    mix = (FailureKind("a", 3.0, 0.0, 10.0, 0.5, 0.0, "t"), FailureKind("b", 1.0, 0.0, 2.0, 0.0, 1.0, "t"))
    nodes, hours = kept_state_exposure(mix, rack_nodes=3)
    assert nodes == pytest.approx(0.75 * (1 + 0.5 * 2))
    assert hours == pytest.approx(0.75 * 2 * 10.0)
    assert nodes_per_failure(mix, 3) == pytest.approx(nodes + 0.25)
    assert node_hours_per_failure(mix, 3) == pytest.approx(hours + 0.25 * 2.0)


@pytest.mark.parametrize("placement", ["spread", "packed"])
def test_default_fleet_shrinks_as_the_closed_form_says(placement):
    """Rack-wide events take one copy (spread) or several (packed), and a 30-day run starts with
    no node in repair: the closed form is given both (copy_hours, repair_warmup) and must agree."""
    result = simulate(FleetConfig(gpus=16384, days=30, placement=placement), seeds=20)
    s = result.summary()["shrink"]
    assert abs(s["degraded"]["mean"] - result.plan.shrunk.degraded) <= s["degraded"]["ci"]
    assert abs(s["goodput"]["mean"] - result.plan.shrunk.outcome.goodput) <= s["goodput"]["ci"]
