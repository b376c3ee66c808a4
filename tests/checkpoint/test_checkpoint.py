"""Persistent checkpoints: round trip, async writer, atomicity under crashes, verification."""
import hashlib
import json
import os
import select
import signal
import threading
import time

import pytest
import torch

from hotspare.checkpoint import (AsyncCheckpointer, CheckpointError, CheckpointInfo,
                                 fingerprint_of, latest, load, save)
from hotspare.checkpoint import auth, layout, load_key, newest_valid, sidecar, store, verify, within
from hotspare.errors import HotspareError

# dcp.save/load(no_dist=True) warn that they assume one process: that is the design.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(seed=0, big=False):
    g = torch.Generator().manual_seed(seed)
    t = {
        "model/blocks.0.qkv.weight": torch.randn(8, 24, generator=g),
        "model/blocks.0.ln.bias": torch.randn(8, generator=g).to(torch.bfloat16),
        "model/half": torch.randn(3, 3, generator=g).half(),
        "optimizer/state/3/exp_avg": torch.randn(8, 24, generator=g),
        "optimizer/state/3/step": torch.tensor(seed + 7, dtype=torch.int64),   # 0-dim
        "optimizer/state/4/mask": torch.tensor([True, False, True]),
        "model/empty": torch.zeros(0, 5),
        "rng/ids": torch.arange(10, dtype=torch.int64) * (2 ** 40),
    }
    if big:
        t["model/big"] = torch.randn(1 << 20, generator=g)    # 4 MiB
    return t


def _fp(tensors):
    return fingerprint_of({k: (str(v.dtype), list(v.shape)) for k, v in tensors.items()})


META = {"tree": {"optimizer": {"param_groups": [{"lr": 0.001, "betas": [0.9, 0.95]}]}},
        "epoch": 3, "note": "ünïcode", "none": None}


def _assert_same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8) if a[k].numel() else a[k],
                           b[k].view(-1).view(torch.uint8) if b[k].numel() else b[k]), k


def test_round_trip_bit_exact(tmp_path):
    t = _state()
    t["model/nan"] = torch.tensor([float("nan"), -0.0, float("inf")])
    fp = _fp(t)
    info = save(str(tmp_path), 12, t, META, fp)
    assert isinstance(info, CheckpointInfo) and info.step == 12 and info.fingerprint == fp
    assert os.path.basename(info.path) == "step-000000012"
    assert info.nbytes == sum(v.nbytes for v in t.values())
    assert (tmp_path / "LATEST").read_text().strip() == "step-000000012"
    side = json.loads((tmp_path / "step-000000012" / "hotspare.json").read_text())
    assert side["version"] == store.FORMAT_VERSION and side["step"] == 12

    for arg in (str(tmp_path), info.path):
        step, got, meta, linfo = load(arg, fingerprint=fp)
        assert step == 12 and meta == META and linfo == info
        _assert_same(got, t)
        assert got["optimizer/state/3/step"].dim() == 0
    assert latest(str(tmp_path)) == info
    assert issubclass(CheckpointError, HotspareError)


def test_fingerprint_helper():
    a = fingerprint_of({"w": ("torch.float32", [2, 3]), "b": ("torch.float32", [3])})
    assert a == fingerprint_of({"b": (torch.float32, (3,)), "w": ("torch.float32", (2, 3))})
    assert a != fingerprint_of({"w": ("torch.float32", [3, 2]), "b": ("torch.float32", [3])})
    assert a != fingerprint_of({"w": ("torch.bfloat16", [2, 3]), "b": ("torch.float32", [3])})


def test_empty_or_missing_dir(tmp_path):
    assert latest(str(tmp_path)) is None
    assert latest(str(tmp_path / "nope")) is None
    with pytest.raises(CheckpointError, match="no complete checkpoint in"):
        load(str(tmp_path))
    with pytest.raises(CheckpointError, match="does not exist"):
        load(str(tmp_path / "nope"))


def test_foreign_checkpoint_refused(tmp_path):
    t = _state()
    save(str(tmp_path), 1, t, {}, _fp(t))
    other = dict(t, **{"model/extra": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="foreign checkpoint: saved by a job with a "
                                              "different model"):
        load(str(tmp_path), fingerprint=_fp(other))
    load(str(tmp_path))     # no fingerprint given: no check


def test_unknown_version_refused(tmp_path):
    t = _state()
    info = save(str(tmp_path), 1, t, {}, "fp")
    p = os.path.join(info.path, "hotspare.json")
    side = json.load(open(p))
    side["version"] = 99
    json.dump(side, open(p, "w"))
    with pytest.raises(CheckpointError, match="format version 99"):
        load(info.path, "fp")


def _resign(sidecar_path, side, key=None):
    """Rewrite a sidecar signed with ``key`` (default: the tests' key), as its writer would."""
    side["mac"] = auth.mac(key or load_key(), sidecar.signed(side))
    json.dump(side, open(sidecar_path, "w"))


def _data_file(ckpt):
    files = [f for f in os.listdir(ckpt) if f.endswith(".distcp")]
    assert len(files) == 1
    return os.path.join(ckpt, files[0])


def _flip(path, offset, n=16):
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def test_corrupt_tensor_data_refused(tmp_path):
    t = _state(big=True)
    info = save(str(tmp_path), 5, t, META, _fp(t))
    path = _data_file(info.path)
    # The 4 MiB tensor dominates the file: its middle is raw tensor bytes.
    _flip(path, os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match="corrupt checkpoint"):
        load(str(tmp_path), _fp(t))


def test_truncated_tensor_file_refused(tmp_path):
    t = _state(big=True)
    info = save(str(tmp_path), 5, t, META, _fp(t))
    path = _data_file(info.path)
    os.truncate(path, os.path.getsize(path) // 3)
    with pytest.raises(CheckpointError, match="corrupt checkpoint .*distcp was changed after writing"):
        load(info.path, _fp(t))


def test_corrupt_digest_mismatch_message(tmp_path, monkeypatch):
    t = _state()
    info = save(str(tmp_path), 5, t, META, _fp(t))
    p = os.path.join(info.path, "hotspare.json")
    side = json.load(open(p))
    side["digest"] = "0" * 64
    json.dump(side, open(p, "w"))
    with pytest.raises(CheckpointError, match="not signed with this job's checkpoint key"):
        load(info.path, _fp(t))
    _resign(p, side)      # as if the writer itself had recorded a wrong digest
    with pytest.raises(CheckpointError, match="corrupt checkpoint .*digest mismatch"):
        load(info.path, _fp(t))


def test_corrupt_sidecar_refused(tmp_path):
    t = _state()
    info = save(str(tmp_path), 5, t, META, _fp(t))
    p = os.path.join(info.path, "hotspare.json")
    side = json.load(open(p))
    side["meta"]["epoch"] = 4
    _resign(p, side)
    with pytest.raises(CheckpointError, match="corrupt checkpoint .*meta digest"):
        load(info.path)
    open(p, "w").write("{not json")
    with pytest.raises(CheckpointError, match="corrupt checkpoint"):
        load(info.path)


def test_leftover_tmp_ignored(tmp_path):
    t = _state()
    first = save(str(tmp_path), 10, t, META, _fp(t))
    # A crash mid-write: partial files in a .tmp dir, and a bogus step dir without a sidecar.
    crashed = tmp_path / ".tmp-step-20-99999"
    crashed.mkdir()
    (crashed / "__0_0.distcp").write_bytes(b"\x00" * 100)
    (crashed / "hotspare.json").write_text('{"version": 1, "step": 20')
    assert latest(str(tmp_path)) == first
    step, got, _, _ = load(str(tmp_path), _fp(t))
    assert step == 10
    _assert_same(got, t)
    # LATEST lost or garbage: the scan still finds the complete checkpoint only.
    (tmp_path / "LATEST").write_text("garbage")
    assert latest(str(tmp_path)) == first
    # A later successful save prunes leftovers of older steps.
    save(str(tmp_path), 30, t, META, _fp(t))
    assert not crashed.exists()


def _save_in_child_and_kill(directory, point):
    """Fork a writer, let it hang at ``os.<point>`` inside save(), then SIGKILL it there.

    Deterministic: the parent kills only after the child reports it reached that point.
    fork (not a fresh interpreter) keeps the test fast: torch is already imported.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:    # child: never returns into pytest
        try:
            os.close(r)
            real = getattr(os, point)

            def hang(*a, **k):
                if point == "replace" and not str(a[1]).endswith("LATEST"):
                    return real(*a, **k)
                os.write(w, b"ready")
                time.sleep(60)

            setattr(os, point, hang)
            save(directory, 2, {"w": torch.full((1000,), 2.0), "step": torch.tensor(2)},
                 {"v": 2}, "fp")
        finally:
            os._exit(1)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 30)
        assert ready and os.read(r, 5) == b"ready", "the writer never reached " + point
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("point", ["rename", "replace"])
def test_sigkill_mid_save_keeps_previous(tmp_path, point):
    """A writer killed before publishing (rename) or before LATEST moves (replace)."""
    d = str(tmp_path)
    first = save(d, 1, {"w": torch.full((1000,), 1.0), "step": torch.tensor(1)}, {"v": 1}, "fp")
    _save_in_child_and_kill(d, point)
    assert latest(d) == first
    step, got, meta, _ = load(d, "fp")
    assert step == 1 and meta == {"v": 1} and torch.equal(got["w"], torch.full((1000,), 1.0))
    if point == "rename":   # killed with everything written but unpublished
        assert any(n.startswith(".tmp-step-2-") for n in os.listdir(d))
    else:   # published but not yet LATEST: complete, and loadable by its path
        assert load(os.path.join(d, "step-000000002"), "fp")[0] == 2
    # The next write recovers cleanly.
    info = save(d, 3, {"w": torch.full((1000,), 3.0), "step": torch.tensor(3)}, {"v": 3}, "fp")
    assert latest(d) == info and load(d, "fp")[0] == 3
    assert not [n for n in os.listdir(d) if n.startswith(".tmp-")]


def test_keep_pruning(tmp_path):
    t = _state()
    d = str(tmp_path)
    for s in (1, 2, 3, 4):
        save(d, s, t, {"s": s}, "fp", keep=2)
    assert sorted(n for n in os.listdir(d) if n.startswith("step-")) == [
        "step-000000003", "step-000000004"]
    # LATEST is never pruned, even when it is older than the others (e.g. after a rollback).
    save(d, 9, t, {}, "fp", keep=3)
    (tmp_path / "LATEST").write_text("step-000000003\n")
    layout.prune(d, keep=1, just_saved=9)
    assert sorted(n for n in os.listdir(d) if n.startswith("step-")) == [
        "step-000000003", "step-000000009"]
    # Saving a step that already exists replaces it atomically.
    info = save(d, 9, t, {"again": True}, "fp", keep=5)
    assert load(d, "fp")[2] == {"again": True} and latest(d) == info
    assert not [n for n in os.listdir(d) if n.startswith(".")]


def _gate(monkeypatch):
    """Hold the background write until the test releases it: storage 'infinitely slow'."""
    started, release = threading.Event(), threading.Event()
    real = store.save

    def slow_save(*a, **k):
        started.set()
        assert release.wait(10)
        return real(*a, **k)

    monkeypatch.setattr(store, "save", slow_save)
    return started, release


def test_async_submit_does_not_block(tmp_path, monkeypatch):
    started, release = _gate(monkeypatch)
    ck = AsyncCheckpointer(str(tmp_path), "fp", keep=2)
    t = _state(big=True)
    expected = {k: v.clone() for k, v in t.items()}
    assert ck.submit(4, t, META) is True            # returns while storage is blocked
    for v in t.values():                             # the caller trains on: mutate in place
        if v.is_floating_point():
            v.add_(1)
    META_after = dict(META, epoch=99)
    assert started.wait(10)
    assert ck.poll() is None and ck.busy
    assert ck.submit(5, t, META_after) is False      # in flight: skipped, not queued
    release.set()
    info = ck.wait(10)
    assert info is not None and info.step == 4
    assert ck.poll() is None                         # reported once
    step, got, meta, _ = load(str(tmp_path), "fp")
    assert step == 4 and meta == META
    _assert_same(got, expected)                      # the snapshot, not the mutated tensors
    assert ck.submit(6, t, META) is True             # free again
    assert ck.wait(10).step == 6


def test_async_error_reraised_in_poll(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    ck = AsyncCheckpointer(str(blocker), "fp")
    assert ck.submit(1, {"w": torch.ones(2)}, {}) is True
    ck._thread.join(10)
    with pytest.raises(CheckpointError, match="checkpoint directory"):
        ck.poll()
    assert ck.poll() is None
    with pytest.raises(CheckpointError, match="JSON-serialisable"):
        ck.submit(2, {"w": torch.ones(2)}, {"bad": object()})


def test_async_on_done_hears_of_a_write_the_moment_it_is_durable(tmp_path, monkeypatch):
    started, release = _gate(monkeypatch)
    heard, failed = [], []
    ck = AsyncCheckpointer(str(tmp_path), "fp", on_done=lambda info: heard.append((info, latest(str(tmp_path)))))
    assert ck.submit(7, {"w": torch.ones(2)}, {}) is True
    assert started.wait(10) and heard == []
    release.set()
    ck._thread.join(10)
    (info, on_disk), = heard                         # from the writer thread, nobody polled
    assert info.step == 7 and on_disk.step == 7      # ... and LATEST already names it
    assert ck.poll() is None                         # reported once, to on_done

    def broken(info):
        failed.append(info.step)
        raise OSError("link gone")
    ck2 = AsyncCheckpointer(str(tmp_path), "fp", on_done=broken)
    assert ck2.submit(8, {"w": torch.ones(2)}, {}) is True
    ck2._thread.join(10)
    with pytest.raises(CheckpointError, match="link gone"):
        ck2.poll()                                   # a failing callback is not lost either
    assert failed == [8]


def test_async_intervals(tmp_path):
    ck = AsyncCheckpointer(str(tmp_path), "fp", interval_steps=10)
    assert not ck.due(3) and ck.due(10)
    assert ck.submit(10, {"w": torch.ones(1)}, {})
    ck.wait(10)
    assert not ck.due(15) and ck.due(20)
    ck2 = AsyncCheckpointer(str(tmp_path), "fp", interval_seconds=3600)
    assert not ck2.due(1)
    ck2._last_time -= 3601
    assert ck2.due(1)
    with pytest.raises(CheckpointError):
        AsyncCheckpointer(str(tmp_path), "fp", interval_steps=0)


# ---------------------------------------------------------------------------- trust nothing on disk
_PLANTED = """
import os
class P:
    def __reduce__(self):
        return (os.system, ("touch {marker}",))
"""


def _planted_pickle(marker):
    import pickle
    ns = {}
    exec(_PLANTED.format(marker=marker), ns)
    return pickle.dumps(ns["P"]())


def test_a_planted_pickle_in_metadata_never_runs(tmp_path):
    t = _state()
    info = save(str(tmp_path / "ckpt"), 5, t, META, _fp(t))
    marker = tmp_path / "pwned"
    md = os.path.join(info.path, ".metadata")
    open(md, "wb").write(_planted_pickle(marker))
    with pytest.raises(CheckpointError, match=r"\.metadata was changed after writing"):
        load(info.path, _fp(t))
    assert not marker.exists()
    # Even with the MAC forged (someone holding the key), the restricted unpickler refuses it.
    side = json.load(open(os.path.join(info.path, "hotspare.json")))
    side["files"][".metadata"] = hashlib.sha256(open(md, "rb").read()).hexdigest()
    _resign(os.path.join(info.path, "hotspare.json"), side)
    with pytest.raises(CheckpointError, match=r"not plain DCP metadata .*posix.system.*nothing in it was run"):
        load(info.path, _fp(t))
    assert not marker.exists()


def test_a_checkpoint_signed_with_another_key_or_unsigned_is_refused(tmp_path):
    t = _state()
    info = save(str(tmp_path), 5, t, META, _fp(t), key=b"k" * 32)
    with pytest.raises(CheckpointError, match="not signed with this job's checkpoint key"):
        load(info.path, _fp(t))
    with pytest.raises(CheckpointError, match="not signed"):
        verify(info.path)
    assert load(info.path, _fp(t), key=b"k" * 32)[0] == 5
    p = os.path.join(info.path, "hotspare.json")
    side = json.load(open(p))
    side["step"] = 50                 # a sidecar edited to claim another step
    json.dump(side, open(p, "w"))
    with pytest.raises(CheckpointError, match="not signed"):
        load(info.path, _fp(t), key=b"k" * 32)


def test_extra_or_linked_files_in_a_checkpoint_are_refused(tmp_path):
    t = _state()
    info = save(str(tmp_path), 5, t, META, _fp(t))
    (tmp_path / "step-000000005" / "extra.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"unexpected \['extra.distcp'\]"):
        verify(info.path)
    os.remove(tmp_path / "step-000000005" / "extra.distcp")
    data = _data_file(info.path)
    os.rename(data, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", data)
    with pytest.raises(CheckpointError, match="is not a regular file"):
        verify(info.path)


def test_newest_valid_walks_back_past_a_damaged_newest_and_says_why(tmp_path):
    t = _state()
    save(str(tmp_path), 10, t, META, _fp(t), keep=3)
    newest = save(str(tmp_path), 20, _state(1), META, _fp(t), keep=3)
    _flip(_data_file(newest.path), 40)
    info, refused = newest_valid(str(tmp_path))
    assert info.step == 10
    assert [p for p, _ in refused] == [newest.path] and "changed after writing" in refused[0][1]
    with pytest.raises(CheckpointError, match="changed after writing"):
        load(newest.path)               # a named checkpoint is that one or an error, never another
    # A bad sidecar is an error for that checkpoint, not a silent other step.
    open(os.path.join(newest.path, "hotspare.json"), "w").write("{not json")
    info, refused = newest_valid(str(tmp_path))
    assert info.step == 10 and "cannot be read" in refused[0][1]
    # A step folder that is a link to somewhere else is not one of ours, signed or not.
    os.rename(newest.path, tmp_path / "aside")
    save(str(tmp_path / "other"), 30, t, META, _fp(t))
    os.symlink(tmp_path / "other" / "step-000000030", tmp_path / "step-000000030")
    info, refused = newest_valid(str(tmp_path))
    assert info.step == 10 and "symbolic link" in refused[0][1]


def test_within_resolves_symbolic_links(tmp_path):
    root = tmp_path / "ckpts"
    (root / "step-000000001").mkdir(parents=True)
    (tmp_path / "planted").mkdir()
    os.symlink(tmp_path / "planted", root / "step-000000002")
    assert within(str(root / "step-000000001"), [str(root)])
    assert not within(str(root / "step-000000002"), [str(root)])
    assert not within(str(root / ".." / "planted"), [str(root)])
    assert not within(str(tmp_path / "ckpts-other"), [str(root)])


def test_the_key_file_is_made_private_and_a_readable_one_is_refused(tmp_path):
    path = tmp_path / "cfg" / "checkpoint.key"
    key = auth.load_key(str(path))
    assert len(key) == 32 and (os.stat(path).st_mode & 0o777) == 0o600
    assert auth.load_key(str(path)) == key                     # survives: the same key next time
    os.chmod(path, 0o644)
    with pytest.raises(auth.CheckpointKeyError, match="chmod 600"):
        auth.load_key(str(path))
    with pytest.raises(auth.CheckpointKeyError, match="does not exist"):
        auth.load_key(str(tmp_path / "none"), create=False)
