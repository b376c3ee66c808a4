"""Someone with write access to a shared checkpoint directory, and no key, plants files: each is
refused before it costs memory or time (bounded reads, docs/CHECKPOINTS.md), and a pickle that
is refused sets nothing on the way."""
import json
import os
import pickle
import time
import tracemalloc

import pytest
import torch

from hotspare.checkpoint import CheckpointError, fingerprint_of, latest, load, load_key, newest_valid, save, verify
from hotspare.checkpoint import auth, layout, sidecar
from hotspare.checkpoint.metadata import UnsafeMetadata, parse
from torch.distributed.checkpoint import metadata as dcp_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state():
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "step": torch.tensor(7)}


def _fp(t):
    return fingerprint_of({k: (str(v.dtype), list(v.shape)) for k, v in t.items()})


def _measured(fn):
    """(what ``fn`` raised, peak bytes it allocated, seconds it took)."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        fn()
    except CheckpointError as e:
        raised = e
    else:
        raised = None
    took = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return raised, peak, took


def test_a_planted_60_mib_sidecar_is_refused_before_it_is_read(tmp_path):
    """The case of issue 29: 60 MiB of JSON cost ~1.5 GB and 14 s to parse before the MAC
    refused it. Its size is read first now: nothing of it is read at all."""
    t = _state()
    good = save(str(tmp_path), 5, t, {}, _fp(t))
    planted = tmp_path / "step-000000009"
    planted.mkdir()
    with open(planted / "hotspare.json", "wb") as f:          # what costs most to parse: [[],[],...]
        f.write(b"[" + b"[]," * (20 << 20) + b"[]]")
    assert os.path.getsize(planted / "hotspare.json") > 60 << 20
    (tmp_path / "LATEST").write_text("step-000000009\n")

    raised, peak, took = _measured(lambda: verify(str(planted)))
    assert raised is not None and "more than the" in str(raised) and "cannot be read" in str(raised)
    assert peak < 1 << 20, f"refusing it allocated {peak / 2**20:.1f} MiB"
    assert took < 2.0
    raised, peak, _ = _measured(lambda: newest_valid(str(tmp_path)))   # the walk back takes the good one
    assert raised is None and peak < 4 << 20
    info, refused = newest_valid(str(tmp_path))
    assert info.step == good.step and refused[0][0] == str(planted)
    assert load(str(tmp_path), _fp(t))[0] == 5


def test_a_planted_sidecar_under_the_cap_is_refused_by_its_mac_before_it_is_parsed(tmp_path):
    """Just under the cap, in the form save() writes: the MAC over its raw bytes refuses it,
    unparsed (parsing it took 385 MiB and 2-10 s). Not in that form: parsed only up to 1 MiB."""
    planted = tmp_path / "step-000000009"
    planted.mkdir()
    filler = b"[" + b"[]," * ((layout.SIDECAR_MAX - 200) // 3) + b"[]]"
    (planted / "hotspare.json").write_bytes(b'{"a":' + filler + b',"version":2,"mac":"' + b"0" * 64 + b'"}\n')
    assert os.path.getsize(planted / "hotspare.json") <= layout.SIDECAR_MAX
    del filler
    raised, peak, took = _measured(lambda: verify(str(planted)))
    assert raised is not None and "not signed with this job's checkpoint key" in str(raised)
    assert peak < layout.SIDECAR_MAX + (1 << 20), f"refusing it allocated {peak / 2**20:.1f} MiB"  # its bytes, once
    assert took < 2.0
    (planted / "hotspare.json").write_bytes(b"[" + b"[]," * (sidecar.LEGACY_MAX // 3) + b"[]]")
    raised, peak, _ = _measured(lambda: verify(str(planted)))
    assert raised is not None and "not in the signed form this hotspare writes" in str(raised)
    assert peak < 2 * sidecar.LEGACY_MAX + (1 << 20)
    # A small one in an older form is parsed, and refused by its MAC (a string that is not ASCII
    # included: compare_digest of two strings raised TypeError on it).
    (planted / "hotspare.json").write_text(json.dumps({"version": 2, "mac": "é" * 64}))
    with pytest.raises(CheckpointError, match="not signed with this job's checkpoint key"):
        verify(str(planted))


def test_a_sidecar_save_could_not_read_back_is_never_written(tmp_path):
    t = _state()
    with pytest.raises(CheckpointError, match=r"hotspare.json would be 1[67]\.\d MiB, more than the 16 MiB .* "
                                              r"keep large state in tensors"):
        save(str(tmp_path), 1, t, {"blob": "x" * layout.SIDECAR_MAX}, _fp(t))
    assert latest(str(tmp_path)) is None and not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]


def test_a_huge_metadata_file_in_a_signed_checkpoint_is_refused_without_reading_it(tmp_path):
    t = _state()
    info = save(str(tmp_path), 5, t, {}, _fp(t))
    md = os.path.join(info.path, ".metadata")
    os.truncate(md, 10 << 30)                     # 10 GiB (sparse): it used to be read whole to hash it
    raised, peak, took = _measured(lambda: verify(info.path))
    assert raised is not None and ".metadata cannot be read" in str(raised) and "more than the" in str(raised)
    assert peak < 1 << 20 and took < 2.0


def test_fifos_planted_as_checkpoint_files_are_refused_not_waited_on(tmp_path):
    t = _state()
    info = save(str(tmp_path), 5, t, {}, _fp(t))
    os.remove(tmp_path / "LATEST")
    os.mkfifo(tmp_path / "LATEST")                # reading it would block until someone writes
    assert layout.latest_name(str(tmp_path)) is None
    data = [n for n in os.listdir(info.path) if n.endswith(".distcp")][0]
    os.rename(os.path.join(info.path, data), tmp_path / "aside")
    os.mkfifo(os.path.join(info.path, data))
    with pytest.raises(OSError, match="not a regular file"):
        auth.file_sha256(os.path.join(info.path, data))
    side = os.path.join(info.path, "hotspare.json")
    os.remove(side)
    os.mkfifo(side)
    with pytest.raises(CheckpointError, match="cannot be read .*not a regular file"):
        verify(info.path)


# ---------------------------------------------------------------------------- a refused pickle sets nothing
def _op(code: bytes, text: str = "") -> bytes:
    return code + (text.encode() + b"\n" if text else b"")


def _setting_then_refused(target_global: tuple[str, str], call_with: bytes | None, attr: str) -> bytes:
    """A pickle that takes ``target_global`` (called with ``call_with``, a pickled tuple, if
    given), sets ``attr`` on it by BUILD, then names os.system, which is refused."""
    body = _op(pickle.GLOBAL, f"{target_global[0]}\n{target_global[1]}")
    if call_with is not None:
        body += call_with + pickle.REDUCE
    # BUILD with (None, {attr: "planted"}): setattr for each slot-state item, on whatever it is.
    body += (pickle.NONE + pickle.EMPTY_DICT + pickle.SHORT_BINUNICODE + bytes([len(attr)]) + attr.encode()
             + pickle.SHORT_BINUNICODE + b"\x07planted" + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD + pickle.POP)
    return pickle.PROTO + b"\x02" + body + _op(pickle.GLOBAL, "os\nsystem") + pickle.STOP


@pytest.mark.parametrize("target, call_with", [
    (("torch.distributed.checkpoint.metadata", "Metadata"), None),                     # an allowed class itself
    (("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),               # an enum member: a singleton
     pickle.MARK + pickle.BININT1 + b"\x00" + pickle.TUPLE),
    (("torch.serialization", "_get_layout"), None),                                  # our stand-in function
])
def test_a_refused_pickle_sets_no_attribute_on_anything_that_outlives_it(target, call_with):
    data = _setting_then_refused(target, call_with, "hotspare_planted")
    with pytest.raises(UnsafeMetadata, match="sets state on a"):
        parse(data, set())
    from hotspare.checkpoint import metadata as md
    survivors = [dcp_metadata.Metadata, dcp_metadata._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT, md._layout]
    assert not any(hasattr(obj, "hotspare_planted") for obj in survivors)


def test_state_with_a_field_the_dataclass_lacks_is_refused_before_it_is_set():
    body = (_op(pickle.GLOBAL, "torch.distributed.checkpoint.metadata\nChunkStorageMetadata")
            + pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.EMPTY_DICT
            + pickle.SHORT_BINUNICODE + b"\x08__eq__xx" + pickle.NONE + pickle.SETITEM + pickle.BUILD)
    with pytest.raises(UnsafeMetadata, match=r"sets \['__eq__xx'\] on a ChunkStorageMetadata"):
        parse(pickle.PROTO + b"\x02" + body + pickle.STOP, set())


def test_a_real_checkpoint_still_loads_through_the_checked_unpickler(tmp_path):
    t = {"a": torch.randn(3, 4), "b": torch.tensor(3), "c": torch.zeros(0, 5).bfloat16()}
    info = save(str(tmp_path), 2, t, {"k": [1, 2]}, _fp(t))
    step, back, meta, _ = load(info.path, _fp(t))
    assert step == 2 and meta == {"k": [1, 2]} and all(torch.equal(back[k], t[k]) for k in t)
    side = json.loads(open(os.path.join(info.path, "hotspare.json")).read())
    assert auth.mac_ok(load_key(), sidecar.signed(side), side["mac"])
