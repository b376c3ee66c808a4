"""recover_shards: where a sharded job's lost shards come from, read like the fault model."""
import pytest

from hotspare.policy.recoverability import Placement, recover_shards

FSDP = Placement(world=32, ranks_per_host=8)                      # 4 hosts, buddy = next host
HSDP = Placement(world=32, ranks_per_host=8, replicate=2, buddies=False)   # groups = hosts 0-1, 2-3


def sources(decision):
    return {s.rank: (s.source, s.from_rank) for s in decision.sources}


def test_layout_follows_init_device_mesh_and_buddies_sit_one_host_on():
    assert HSDP.shard == 16 and HSDP.group(17) == 1 and HSDP.replicas(17) == [1]
    assert FSDP.buddy(3) == 11 and FSDP.buddy(27) == 3                 # wraps around
    assert all(FSDP.host(FSDP.buddy(r)) != FSDP.host(r) for r in range(32))
    assert Placement(world=8, ranks_per_host=8).buddy(0) is None        # one host: nowhere to put it


def test_a_dead_rank_comes_back_from_its_buddy_a_draining_one_from_itself():
    d = recover_shards(FSDP, dead_ranks={5})
    assert d.path == "memory" and sources(d) == {5: ("buddy", 13)}
    d = recover_shards(FSDP, draining_ranks={5})
    assert d.path == "memory" and sources(d) == {5: ("own", 5)}


def test_hsdp_prefers_a_live_replica_and_a_healthy_one_over_a_draining_one():
    assert sources(recover_shards(HSDP, dead_ranks={3})) == {3: ("replica", 19)}
    three = Placement(world=48, ranks_per_host=8, replicate=3, buddies=False)
    d = recover_shards(three, dead_ranks={0}, draining_ranks={16})
    assert sources(d)[0] == ("replica", 32)


def test_a_rank_and_its_buddys_host_fall_back_to_the_checkpoint():
    d = recover_shards(FSDP, dead_ranks={0}, dead_hosts={1})
    assert d.path == "checkpoint"
    assert sources(d)[0] == ("checkpoint", None)
    assert all(sources(d)[r][0] == "buddy" for r in range(8, 16))      # host 1's own ranks are fine
    assert "host 1" in d.reason and "checkpoint" in d.reason


def test_a_buddys_worker_crash_loses_the_snapshot_only_if_the_worker_held_it():
    assert recover_shards(FSDP, dead_ranks={0, 8}).path == "memory"
    in_worker = Placement(world=32, ranks_per_host=8, snapshot_in="worker")
    d = recover_shards(in_worker, dead_ranks={0, 8})
    assert d.path == "checkpoint" and sources(d)[0][0] == "checkpoint" and sources(d)[8][0] == "buddy"


@pytest.mark.parametrize("hosts,path", [({0}, "memory"), ({0, 2}, "memory"), ({0, 1}, "checkpoint"),
                                        ({3, 0}, "checkpoint")])   # host 3's buddy host is 0
def test_whole_hosts_survive_unless_two_are_adjacent(hosts, path):
    assert recover_shards(FSDP, dead_hosts=hosts).path == path


def test_hsdp_survives_a_replica_group_but_not_every_copy_of_a_shard():
    assert recover_shards(HSDP, dead_hosts={0, 1}).path == "memory"            # all of group 0
    assert recover_shards(HSDP, dead_ranks={0, 17}).path == "memory"           # different shards
    d = recover_shards(HSDP, dead_ranks={0, 16})                               # shard 0 twice
    assert d.path == "checkpoint" and d.count("checkpoint") == 2
    with_buddies = Placement(world=32, ranks_per_host=8, replicate=2)
    d = recover_shards(with_buddies, dead_ranks={0, 16})
    assert d.path == "memory" and sources(d) == {0: ("buddy", 8), 16: ("buddy", 24)}


def test_no_checkpoint_means_stop_and_nothing_lost_means_nothing_to_do():
    d = recover_shards(Placement(world=16, ranks_per_host=8, buddies=False), dead_ranks={1},
                       has_checkpoint=False)
    assert d.path == "stop" and sources(d) == {1: ("none", None)}
    assert recover_shards(FSDP).path == "memory" and recover_shards(FSDP).sources == ()


def test_a_wider_buddy_jump_survives_adjacent_hosts():
    far = Placement(world=64, ranks_per_host=8, buddy_jump=4)          # 8 hosts, buddy 4 hosts on
    assert recover_shards(far, dead_hosts={0, 1, 2, 3}).path == "memory"
    assert recover_shards(far, dead_hosts={0, 4}).path == "checkpoint"


@pytest.mark.parametrize("kwargs,needle", [
    (dict(world=30, ranks_per_host=8), "whole hosts"),
    (dict(world=32, ranks_per_host=8, replicate=3), "multiple of replicate"),
    (dict(world=32, ranks_per_host=8, buddy_jump=4), "own host"),
    (dict(world=32, ranks_per_host=8, snapshot_in="disk"), "snapshot_in"),
])
def test_impossible_placements_are_rejected(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        Placement(**kwargs)


def test_ranks_and_hosts_outside_the_job_are_rejected():
    with pytest.raises(ValueError, match="rank 32"):
        recover_shards(FSDP, dead_ranks={32})
    with pytest.raises(ValueError, match="host 4"):
        recover_shards(FSDP, dead_hosts={4})


def test_decision_code_imports_neither_torch_nor_sockets():
    import subprocess
    import sys
    code = ("import sys, hotspare.policy.recoverability, hotspare.sim.pool, hotspare.sim.economics, "
            "hotspare.sim.sharded; bad = [m for m in ('torch', 'socket') if m in sys.modules]; "
            "assert not bad, bad; assert 'numpy' not in sys.modules or 'hotspare.sim.fleet' in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
