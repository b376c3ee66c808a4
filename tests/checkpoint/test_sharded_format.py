"""Sharded checkpoints on disk (hotspare/checkpoint/sharded.py): every rank's shard round-trips
bit for bit; a checkpoint whose index is unsigned, or any of whose shards was changed, is
missing or added to, is refused before a byte of it is interpreted; the walk back to the newest
checkpoint that verifies skips it; nothing is ever unpickled (there is no pickle to read)."""
import json
import os
import threading

import pytest
import torch

from hotspare.checkpoint import CheckpointError, load_key, newest_valid, verify
from hotspare.checkpoint import sharded as sc

WORLD = 3


def _shard(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    tensors = [(("model", "w"), torch.randn(4, 5, generator=g)),
               (("model", "b"), torch.randn(5, generator=g).to(torch.bfloat16)),
               (("optimizer", "state", 0, "step"), torch.tensor(float(step))),
               (("optimizer", "state", 0, "mask"), torch.tensor([True, False])),
               (("model", "empty"), torch.zeros(0, 3))]
    manifest = {"step": step, "entries": [[list(p), str(t.dtype).removeprefix("torch."), list(t.shape)]
                                          for p, t in tensors], "trees": {"model": ["d", []]}}
    row = torch.randint(0, 255, (17,), dtype=torch.uint8, generator=g)
    return tensors, manifest, row


def _write(directory, step, key, gen=1):
    folder = sc.tmp_folder(str(directory), step, gen)
    for r in range(WORLD):      # ranks write in any order; rank 0 publishes once all are there
        tensors, manifest, row = _shard(r, step)
        sc.write_shard(folder, step, r, WORLD, f"fp{r}", manifest, tensors, row)
    return sc.publish(str(directory), folder, step, WORLD, "fp0", key=key)


@pytest.fixture
def key():
    return load_key()


def test_every_rank_reads_back_its_own_shard_bit_for_bit(tmp_path, key):
    info = _write(tmp_path, 6, key)
    assert info.step == 6 and os.path.basename(info.path) == "step-000000006"
    assert verify(info.path, key).step == 6                     # the coordinator's check: every file
    for r in range(WORLD):
        tensors, manifest, row = _shard(r, 6)
        got = sc.read_shard(info.path, r, WORLD, key=key, fingerprint=f"fp{r}")
        assert got.step == 6 and got.manifest == manifest and torch.equal(got.row, row)
        assert [p for p, _ in got.tensors] == [p for p, _ in tensors]
        for (_, a), (_, b) in zip(got.tensors, tensors):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_publish_waits_for_the_slowest_rank(tmp_path, key):
    folder = sc.tmp_folder(str(tmp_path), 2, 1)
    def write(r):
        tensors, manifest, _ = _shard(r, 2)
        sc.write_shard(folder, 2, r, WORLD, "fp", manifest, tensors, None)
    for r in range(WORLD - 1):
        write(r)
    late = threading.Timer(0.3, write, (WORLD - 1,))
    late.start()
    info = sc.publish(str(tmp_path), folder, 2, WORLD, "fp", key=key, timeout_s=10)
    late.join()
    assert sc.read_shard(info.path, WORLD - 1, WORLD, key=key).row is None


def test_a_shard_that_never_arrives_leaves_nothing_published(tmp_path, key):
    folder = sc.tmp_folder(str(tmp_path), 4, 1)
    sc.write_shard(folder, 4, 0, WORLD, "fp", _shard(0, 4)[1], _shard(0, 4)[0], None)
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1, 2\] did not write their shard"):
        sc.publish(str(tmp_path), folder, 4, WORLD, "fp", key=key, timeout_s=0.2)
    assert newest_valid(str(tmp_path), key) == (None, [])
    with pytest.raises(CheckpointError, match="their generation ended"):      # given up at once
        sc.publish(str(tmp_path), folder, 4, WORLD, "fp", key=key, timeout_s=60, cancelled=lambda: True)


@pytest.mark.parametrize("damage", ["flip a byte of rank 1's tensors", "edit rank 1's header",
                                    "drop rank 2's shard", "plant a file", "unsigned index"])
def test_a_tampered_sharded_checkpoint_is_never_loaded_and_the_older_one_is_used(tmp_path, key, damage):
    older = _write(tmp_path, 3, key)
    newest = _write(tmp_path, 6, key)
    p = newest.path
    if damage.startswith("flip"):
        b = bytearray(open(os.path.join(p, "rank-00001.bin"), "rb").read())
        b[7] ^= 1
        open(os.path.join(p, "rank-00001.bin"), "wb").write(b)
    elif damage.startswith("edit"):
        h = json.load(open(os.path.join(p, "rank-00001.json")))
        h["manifest"]["step"] = 99
        json.dump(h, open(os.path.join(p, "rank-00001.json"), "w"))
    elif damage.startswith("drop"):
        os.remove(os.path.join(p, "rank-00002.bin"))
    elif damage.startswith("plant"):
        open(os.path.join(p, ".metadata"), "wb").write(b"\x80\x04not a pickle anyone reads")
    else:
        side = json.loads(open(os.path.join(p, "hotspare.json")).read())
        side["step"] = 7
        open(os.path.join(p, "hotspare.json"), "w").write(json.dumps(side))
    with pytest.raises(CheckpointError):
        verify(p, key)
    bad_rank = 2 if damage.startswith("drop") else 1
    with pytest.raises(CheckpointError):
        sc.read_shard(p, bad_rank, WORLD, key=key)
    info, refused = newest_valid(str(tmp_path), key)
    assert info.path == older.path and [r[0] for r in refused] == [p]


def test_a_shard_of_another_world_or_model_is_refused(tmp_path, key):
    info = _write(tmp_path, 1, key)
    with pytest.raises(CheckpointError, match="holds 3 shards; this job has 4 ranks"):
        sc.read_shard(info.path, 0, 4, key=key)
    with pytest.raises(CheckpointError, match="foreign checkpoint"):
        sc.read_shard(info.path, 0, WORLD, key=key, fingerprint="another")
    with pytest.raises(CheckpointError, match="not signed with this job's checkpoint key"):
        sc.read_shard(info.path, 0, WORLD, key=b"k" * 32)
