"""The fleet simulator: agrees with the closed form where that is exact, replays the real
recovery policy, and shows what the closed form cannot (spare exhaustion, packed replicas)."""
import dataclasses
import time

import pytest

from hotspare.errors import ConfigError
from hotspare.sim import fleet, validation
from hotspare.sim.fleet import FleetConfig, simulate
from hotspare.sim.presets import PRESETS, FailureKind


def one_kind(detect_h=0.0, destroys=0.0, repair_h=24.0, correlated=0.0):
    return (FailureKind("x", 1.0, detect_h, repair_h, correlated, destroys, "test"),)


@pytest.mark.parametrize("name", validation.CASES)
def test_simulated_goodput_matches_the_closed_form(name):
    """Where the closed form is exact, it falls inside the simulator's 95% interval (30 seeds)."""
    for check in validation.compare(name, seeds=30, seed=0):
        assert 0 < check.ci < 0.015, "interval too wide for the check to mean anything"
        assert check.within, check


def test_every_live_failover_decision_comes_from_plan_recovery(monkeypatch):
    calls = []
    real = fleet.plan_recovery

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(fleet, "plan_recovery", spy)
    result = simulate(FleetConfig(gpus=1024, days=60, afr=1.0), seeds=3)
    failures = sum(r.failures for r in result.hotspare)
    assert failures > 100
    assert len(calls) >= failures      # one per lost shard, so at least one per failure
    assert sum(sum(r.paths.values()) for r in result.hotspare) == failures


def test_same_failures_for_both_policies_and_reproducible():
    cfg = FleetConfig(gpus=2048, days=30)
    a, b = simulate(cfg, seeds=4, seed=7), simulate(cfg, seeds=4, seed=7)
    assert [r.failures for r in a.checkpoint] == [r.failures for r in a.hotspare]
    assert a.summary() == b.summary()
    assert simulate(cfg, seeds=4, seed=8).summary() != a.summary()


def test_without_a_second_copy_every_failure_falls_back():
    result = simulate(FleetConfig(gpus=128, days=365, afr=0.5, replica_nodes=16), seeds=3)
    assert set(result.summary()["hotspare"]["paths"]) == {"checkpoint"}
    assert result.summary()["hotspare"]["zero_loss_share"] == 0.0


def test_packed_replicas_lose_state_to_rack_wide_events_spread_ones_do_not():
    base = dict(gpus=256, days=365, afr=0.3, mix=one_kind(correlated=1.0), replica_nodes=16,
                rack_nodes=4, spares=100)   # 2 copies of the state
    packed = simulate(FleetConfig(placement="packed", **base), seeds=3).summary()["hotspare"]
    spread = simulate(FleetConfig(placement="spread", **base), seeds=3).summary()["hotspare"]
    assert packed["paths"].get("checkpoint", 0) > 0.9 * sum(packed["paths"].values())
    assert "checkpoint" not in spread["paths"]


def test_an_empty_pool_means_waiting_for_cold_nodes():
    cfg = FleetConfig(gpus=1024, days=30, afr=0.3, mix=one_kind(), spares=0)
    result = simulate(cfg, seeds=3)
    hs = result.summary()["hotspare"]
    assert set(hs["paths"]) == {"wait"}
    assert sum(r.pool_short for r in result.hotspare) == sum(r.failures for r in result.hotspare)
    roomy = simulate(dataclasses.replace(cfg, spares=100), seeds=3).summary()["hotspare"]
    assert roomy["goodput"]["mean"] > hs["goodput"]["mean"]


def test_erlang_estimate_of_pool_exhaustion_is_conservative():
    result = simulate(FleetConfig(gpus=16384, days=90, afr=0.3), seeds=10)   # auto spares
    failures = sum(r.failures for r in result.hotspare)
    short = sum(r.pool_short for r in result.hotspare)
    assert short / failures <= result.plan.pool_empty


def test_default_fleet_is_close_to_the_closed_form():
    """Rack-wide events and per-kind detection are outside the closed form but move it little."""
    result = simulate(FleetConfig(gpus=16384, days=30), seeds=20)
    hs = result.summary()["hotspare"]["goodput"]
    assert abs(hs["mean"] - result.plan.hotspare.goodput) < 2 * hs["ci"] + 0.002


def test_sixteen_thousand_gpus_for_a_month_twenty_seeds_under_ten_seconds():
    cfg = FleetConfig(gpus=16384, days=30, afr=PRESETS["meta-rsc1"].per_gpu_year)
    start = time.perf_counter()
    simulate(cfg, seeds=20)
    assert time.perf_counter() - start < 10.0


@pytest.mark.parametrize("change,needle", [
    ({"gpus": 1001}, "multiple of gpus-per-node"),
    ({"gpus": 1024, "replica_nodes": 48}, "whole number of copies"),
    ({"gpus": 1024, "placement": "diagonal"}, "placement"),
    ({"gpus": 1024, "mix": one_kind(correlated=2.0)}, "probabilities"),
])
def test_impossible_fleets_are_rejected(change, needle):
    with pytest.raises(ConfigError, match=needle):
        simulate(FleetConfig(**change), seeds=2)
