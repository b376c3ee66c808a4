"""Where a lost rank's shard comes from (hotspare/sharded/plan.py): pure, no torch."""
import pytest

from hotspare.sharded.plan import NONE, BuddyStatus, buddy_of, default_stride, plan_restore


def st(own, held_for, snap=NONE, log=NONE, fresh=NONE):
    return BuddyStatus(own, held_for, snap, log, fresh)


def test_buddy_is_on_the_next_host_and_never_the_rank_itself():
    assert [buddy_of(r, 8, 4) for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]
    assert [buddy_of(r, 4, 1) for r in range(4)] == [1, 2, 3, 0]
    assert default_stride(8, 4) == 4 and default_stride(4, 4) == 1 and default_stride(6, 4) == 1
    with pytest.raises(ValueError):
        buddy_of(0, 4, 4)


def test_a_lost_rank_at_the_first_step_of_its_snapshot_is_replayed_from_the_log():
    # rank 2 lost at step 5 before its snapshot of step 4 arrived: its buddy (3) holds the
    # snapshot of step 3 and the log of step 4
    status = [st(4, 3, 3, 4), st(4, 0, 3, 4), st(NONE, NONE), st(4, 2, 3, 4)]
    plan, reason = plan_restore(status, 4, 1)
    assert reason is None and [(s.rank, s.holder, s.kind, s.snap_step) for s in plan] == [(2, 3, "replay", 3)]


def test_a_snapshot_of_the_target_step_is_loaded_as_it_is():
    status = [st(4, 3, 4), st(4, 0, 3, 4), st(NONE, NONE), st(4, 2, 3, 4, fresh=4)]
    plan, _ = plan_restore(status, 4, 1)
    assert [(s.rank, s.kind) for s in plan] == [(2, "fresh")]
    status[3] = st(4, 2, 4)
    assert [(s.rank, s.kind) for s in plan_restore(status, 4, 1)[0]] == [(2, "snapshot")]


def test_hsdp_prefers_the_live_replica():
    status = [st(4, 3, 3, 4), st(4, 0, 3, 4), st(4, 1, 3, 4), st(NONE, NONE)]
    plan, _ = plan_restore(status, 4, 1, replicas=[[0, 2], [1, 3]])
    assert [(s.rank, s.holder, s.kind) for s in plan] == [(3, 1, "replica")]


def test_a_rank_and_its_buddy_lost_together_need_a_checkpoint():
    status = [st(4, 3, 3, 4), st(4, 0, 3, 4), st(NONE, NONE), st(NONE, NONE)]
    plan, reason = plan_restore(status, 4, 1)
    assert plan == [] and "rank 2" in reason and "buddy rank 3" in reason


def test_a_copy_of_an_older_step_is_refused():
    status = [st(4, 3, 3, 4), st(4, 0, 3, 4), st(NONE, NONE), st(4, 2, 2, 3)]
    plan, reason = plan_restore(status, 4, 1)
    assert plan == [] and "step 2" in reason


def test_ranks_at_the_target_need_nothing():
    status = [st(-1, 3), st(-1, 0), st(-1, 1), st(-1, 2)]
    assert plan_restore(status, -1, 1) == ([], None)
