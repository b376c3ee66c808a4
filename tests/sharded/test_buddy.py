"""Buddy snapshots are checksummed: a corrupt or incomplete one is detected and never loaded; a
buddy holds a snapshot and the run of logs after it, from which any step in between is rebuilt."""
import pytest
import torch

from hotspare.runtime.sharded import snapshot_every
from hotspare.sharded.plan import NONE, BuddyStatus, plan_restore
from hotspare.transfer.buddy import BadPacket, BuddyStore, Buffers, pack, parse_header


def _shard(seed):
    g = torch.Generator().manual_seed(seed)
    return [(("model", "w"), torch.randn(8, 4, generator=g)),
            (("optimizer", "state", 0, "exp_avg"), torch.randn(8, 4, generator=g)),
            (("optimizer", "state", 0, "step"), torch.tensor(3.0))]


def test_a_packet_holds_the_bytes_it_was_given():
    p = pack("state", 3, _shard(0))
    p.verify()
    for (path, t), (q, u) in zip(_shard(0), p.tensors()):
        assert path == q and torch.equal(t, u)


def test_one_flipped_byte_is_detected_and_the_store_keeps_the_previous_snapshot():
    store = BuddyStore()
    good = pack("state", 3, _shard(0))
    store.confirm(2, good, pack("log", 4, _shard(1)))
    bad = pack("state", 4, _shard(2))
    bad.data[17] ^= 1
    with pytest.raises(BadPacket, match="checksum"):
        bad.verify()
    with pytest.raises(BadPacket):
        store.confirm(2, bad, None)
    with pytest.raises(BadPacket):
        store.offer_fresh(2, bad)
    assert store.state is good and store.steps() == (3, 4, -2)


def test_a_truncated_or_lying_header_is_refused():
    p = pack("state", 3, _shard(0))
    with pytest.raises(BadPacket, match="announced"):
        parse_header(p.header(), p.nbytes - 1)
    with pytest.raises(BadPacket, match="malformed"):
        parse_header(b'{"kind": "state", "step": 1}', 0)
    with pytest.raises(BadPacket, match="not JSON"):
        parse_header(b"\x80\x04K\x01.", 0)          # a pickle is not a header


def test_a_log_must_sit_on_the_snapshot_of_the_step_before():
    with pytest.raises(BadPacket):
        BuddyStore().confirm(1, pack("state", 3, _shard(0)), pack("log", 6, _shard(1)))


def test_the_buddy_keeps_a_snapshot_and_the_run_of_logs_after_it():
    store = BuddyStore()
    store.keep_state(2, pack("state", 3, _shard(0)))
    for step in (4, 5, 6):
        store.add_log(2, pack("log", step, _shard(step)))
    assert store.steps() == (3, 6, -2) and [g.step for g in store.logs_to(5)] == [4, 5]
    store.add_log(2, pack("log", 5, _shard(9)))         # step 5 failed and ran again: 5 and 6 replaced
    assert [g.step for g in store.logs] == [4, 5]
    with pytest.raises(BadPacket, match="not a run"):
        store.add_log(2, pack("log", 7, _shard(7)))     # a gap: the logs are dropped, never replayed
    assert store.logs == [] and store.steps() == (3, -2, -2)
    store.add_log(2, pack("log", 4, _shard(4)))
    store.keep_state(2, pack("state", 4, _shard(1)))    # a newer snapshot drops the logs it covers
    assert store.steps() == (4, -2, -2)


def test_a_corrupt_log_is_found_before_it_is_replayed():
    log = pack("log", 4, _shard(4))
    log.data[3] ^= 0x10
    with pytest.raises(BadPacket, match="checksum"):
        log.verify()


def test_a_restore_replays_every_logged_step_since_the_snapshot():
    # rank 2 lost at step 6; its buddy (3) holds its snapshot of step 3 and the logs of 4, 5, 6
    status = [BuddyStatus(6, 3, 3, 6), BuddyStatus(6, 0, 3, 6), BuddyStatus(NONE, NONE, NONE, NONE),
              BuddyStatus(6, 2, 3, 6)]
    plan, reason = plan_restore(status, 6, 1)
    assert reason is None and [(s.rank, s.holder, s.kind, s.snap_step) for s in plan] == [(2, 3, "replay", 3)]
    status[3] = BuddyStatus(6, 2, 3, 5)             # its logs stop at step 5: step 6 cannot be rebuilt
    assert plan_restore(status, 6, 1)[0] == []


def test_buffers_are_reused_and_the_cadence_is_checked():
    pool = Buffers(2)
    a = pool.take(64)
    pool.give(a)
    assert pool.take(64) is a and pool.take(64) is not a
    assert snapshot_every({}) == 8 and snapshot_every({"HOTSPARE_SNAPSHOT_EVERY": "0"}) == 0
    with pytest.raises(Exception, match="number of steps"):
        snapshot_every({"HOTSPARE_SNAPSHOT_EVERY": "-1"})
