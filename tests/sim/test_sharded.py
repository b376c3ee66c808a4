"""Sharded jobs on a fleet: the share of failures that fall back to a checkpoint is measured,
and it moves the way the placement says it should."""
import pytest

from hotspare.errors import ConfigError
from hotspare.policy.recoverability import Placement
from hotspare.sim import sharded
from hotspare.sim.presets import FailureKind
from hotspare.sim.sharded import ShardedConfig, combinations, simulate_sharded


def kind(name, correlated=0.0, destroys=0.0):
    return FailureKind(name, 1.0, 30 / 3600, 24.0, correlated, destroys, "test")


def share(cfg, seeds=5):
    return simulate_sharded(cfg, seeds).summary()


def test_every_incident_is_decided_by_recover_shards(monkeypatch):
    calls = []
    real = sharded.recover_shards

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(sharded, "recover_shards", spy)
    result = simulate_sharded(ShardedConfig(gpus=256, days=365, afr=0.5), seeds=2)
    failures = sum(r.failures for r in result.runs)
    destroyed = sum(r.destroyed for r in result.runs)
    assert failures > 100 and 0 < len(calls) <= failures - destroyed


def test_single_gpu_failures_always_recover_from_the_buddy():
    s = share(ShardedConfig(gpus=512, days=365, afr=0.3, mix=(kind("gpu"),)))
    assert s["fallback_share"]["mean"] == 0.0 and set(s["rank_sources"]) == {"buddy"}


def test_without_buddies_or_replicas_every_failure_falls_back_unless_it_drains():
    s = share(ShardedConfig(gpus=512, days=365, afr=0.3, mix=(kind("gpu"),), buddy_jump=0))
    assert s["fallback_share"]["mean"] == 1.0
    drained = share(ShardedConfig(gpus=512, days=365, afr=0.3, mix=(kind("gpu"),), buddy_jump=0,
                                  drain_share=0.5))
    assert 0.35 < drained["fallback_share"]["mean"] < 0.65 and "own" in drained["rank_sources"]


def test_rack_wide_events_defeat_a_next_host_buddy_but_not_one_a_rack_away():
    racks = (kind("network", correlated=1.0),)
    near = share(ShardedConfig(gpus=512, days=365, afr=0.3, mix=racks, rack_nodes=4))
    far = share(ShardedConfig(gpus=512, days=365, afr=0.3, mix=racks, rack_nodes=4, buddy_jump=4))
    assert near["no_copy_share"]["mean"] > 0.99
    assert far["no_copy_share"]["mean"] == 0.0


def test_hsdp_replicas_cover_racks_inside_one_group():
    racks = (kind("network", correlated=1.0),)
    s = share(ShardedConfig(gpus=512, days=365, afr=0.3, mix=racks, rack_nodes=4, replicate=2,
                            buddy_jump=0))
    assert s["no_copy_share"]["mean"] == 0.0 and set(s["rank_sources"]) == {"replica"}


def test_default_mix_falls_back_more_than_state_loss_alone():
    s = share(ShardedConfig(gpus=2048, days=365), seeds=10)
    assert s["no_copy_share"]["mean"] > 2 * s["no_copy_share"]["ci"] > 0
    assert s["fallback_share"]["mean"] == pytest.approx(
        s["destroyed_share"]["mean"] + s["no_copy_share"]["mean"])


def test_combinations_table_for_the_default_placement():
    table = dict((name.split(" (")[0], d.path) for name, d in
                 combinations(Placement(world=32, ranks_per_host=8), rack_hosts=2))
    assert table["one rank"] == "memory" and table["a whole host"] == "memory"
    assert table["two adjacent hosts"] == "checkpoint" and table["a rank and its buddy's host"] == "checkpoint"


@pytest.mark.parametrize("change,needle", [
    ({"drain_share": 1.5}, "drain-share"),
    ({"buddy_jump": -1}, "buddy-jump"),
    ({"gpus": 32, "replicate": 3}, "replicate"),
])
def test_impossible_sharded_jobs_are_rejected(change, needle):
    with pytest.raises(ConfigError, match=needle):
        simulate_sharded(ShardedConfig(**{"gpus": 256, "replica_nodes": 1, **change}), seeds=2)
