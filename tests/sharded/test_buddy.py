"""Buddy snapshots are checksummed: a corrupt or incomplete one is detected and never loaded."""
import pytest
import torch

from hotspare.transfer.buddy import BadPacket, BuddyStore, pack, parse_header


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
