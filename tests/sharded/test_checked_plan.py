"""A buddy copy that fails its checksum when it is about to be sent is never loaded: every rank
drops it alike and the next source is planned -- the older snapshot and its log, else the
checkpoint -- and the report's words say why (hotspare/sharded/fallback.py ``checked_plan``).

The holder's side runs for real (its BuddyStore, real packets, sha256); the process group is a
stand-in whose all-gather gives every other rank's verdict as 0 (theirs verified), as torchft's
manager tests script their collectives."""
from types import SimpleNamespace

import torch

from hotspare.sharded import fallback
from hotspare.sharded.plan import NONE, BuddyStatus
from hotspare.transfer import buddy as wire

WORLD, TARGET = 4, 4


class _Work:
    def wait(self):
        return True


class _Group:
    """Rank ``me``'s verdict from the rank itself; every other rank's 0."""

    def __init__(self, me):
        self.me, self.calls = me, 0

    def all_gather(self, out, mine):
        self.calls += 1
        out.zero_()
        out[self.me] = mine[0]
        return _Work()


def _runtime():
    """Rank 3 keeps rank 2's copies (stride 1): its snapshot of step 3, the log of step 4, and a
    newer snapshot of step 4 that arrived before rank 2 was lost."""
    shard = [(("model", "w"), torch.arange(12, dtype=torch.float32))]
    store = wire.BuddyStore()
    store.keep_state(2, wire.pack("state", 3, shard))
    store.add_log(2, wire.pack("log", 4, shard, {"groups": [], "none": []}))
    store.offer_fresh(2, wire.pack("state", 4, shard))
    members = SimpleNamespace(rank=3, world_size=WORLD, group=_Group(3))
    rt = SimpleNamespace(stride=1, store=store, restores=[], fallback_reason=None,
                         job=SimpleNamespace(members=members, rank=3, progress=SimpleNamespace(committed=TARGET)))
    status = [BuddyStatus(TARGET, 3, 4, NONE), BuddyStatus(TARGET, 0, 4, NONE),
              BuddyStatus(NONE, NONE, NONE, NONE),           # rank 2: lost, a spare now
              BuddyStatus(TARGET, 2, 3, 4, 4)]
    return rt, status


def _flip(packet):
    packet.data[5] ^= 0x40


def test_whole_copies_are_sent_as_planned():
    rt, status = _runtime()
    plan, reason = fallback.checked_plan(rt, status, TARGET, None)
    assert reason is None and [(s.rank, s.holder, s.kind) for s in plan] == [(2, 3, "fresh")]
    assert rt.checksum_notes == {}


def test_a_corrupt_newer_snapshot_is_dropped_and_the_older_one_plus_the_log_replayed():
    rt, status = _runtime()
    _flip(rt.store.fresh)
    plan, reason = fallback.checked_plan(rt, status, TARGET, None)
    assert reason is None and [(s.rank, s.holder, s.kind, s.snap_step) for s in plan] == [(2, 3, "replay", 3)]
    assert rt.store.fresh is None                                   # never sent, never loaded
    assert rt.checksum_notes == {2: "its buddy rank 3's snapshot of step 4 failed its checksum: not loaded"}
    rt.restores.append({"step": TARGET, "source": "replay", "from_rank": 3, "snapshot_step": 3, "bytes": 96})
    rt.job.members.rank = 2                                         # the restored rank's words
    (entry,) = fallback.sources(rt, TARGET)
    assert entry["source"] == "buddy snapshot + log" and "failed its checksum" in entry["why"], entry


def test_every_copy_corrupt_means_the_checkpoint_and_the_reason_says_why():
    rt, status = _runtime()
    _flip(rt.store.fresh)
    _flip(rt.store.state)
    plan, reason = fallback.checked_plan(rt, status, TARGET, None)
    assert plan == [] and reason.startswith("rank 2's shard is not in memory")
    assert "its buddy rank 3's snapshot of step 3 or its logs up to step 4 failed its checksum: not loaded" in reason
    assert rt.store.state is None and rt.store.logs == []
    assert rt.job.members.group.calls == 2                          # one verdict per round, every rank alike
