"""Python's and numpy's global generators, read as fixed-size words, fast.

Every step captures the rank's per-rank state up to four times (runtime/rankstate.py), and the
public ways to read these two generators build Python objects first: ``random.getstate()`` a
tuple of 625 ints (~15 us with packing), numpy's ``get_state()`` a dict holding a fresh array
(~45 us). On a 50 ms step that is ~0.4 % of the training thread. Both generators are Mersenne
twisters whose whole state lies in one C struct:

* numpy's legacy global ``RandomState``: the bit generator's ``mt19937_state`` (624 words and a
  position) at ``bit_generator.ctypes.state_address`` (numpy's documented ctypes interface), and
  the cached Gaussian of the legacy ``normal`` (``has_gauss``, ``gauss``) in the RandomState object;
* Python's ``random``: the ``_random.Random`` object holds its index and 624 words; the cached
  ``gauss_next`` is a plain attribute.

Where the bytes sit inside the objects is not documented, so it is found at start by probing:
throwaway generators are set to known states through the public API, the offsets at which those
bytes appear are taken only when every probe agrees, and the fast reader of the real generator is
then checked against the public API once. Anything unexpected (another layout, a big-endian
machine, another numpy) leaves the public API in charge: ``None`` from the builders below.
The bytes are exactly those of the public API's packing, so a capture taken either way restores
the same way (runtime/rankstate.py loads them through ``setstate`` / ``set_state``)."""
from __future__ import annotations

import ctypes
import functools
import random
import struct
import sys
from typing import Any, Callable

PY_WORDS = 625                      # random.getstate(): 624 state words and the index
PY_FMT = f"<{PY_WORDS}I?d"          # ... then gauss_next (None or a float)
NP_FMT = "<624IIid"                 # numpy's MT19937: key, pos, has_gauss, the cached gaussian
_MT_BYTES = 624 * 4


def _memory(obj: Any, size: int) -> bytes:
    return ctypes.string_at(id(obj), size)


def _offset(probes: list[tuple[Any, bytes]], size: int, align: int) -> int | None:
    """The one offset (a multiple of ``align``) at which every probe object's memory holds its
    expected bytes; None unless exactly one such offset exists."""
    found = None
    for obj, want in probes:
        mem = _memory(obj, size)
        hits = {i for i in range(0, size - len(want) + 1, align) if mem[i:i + len(want)] == want}
        found = hits if found is None else found & hits
    return next(iter(found)) if found is not None and len(found) == 1 else None


# ---------------------------------------------------------------------------------------- Python
def python_save_public() -> bytes:
    version, words, gauss = random.getstate()
    return struct.pack(PY_FMT, *words, gauss is not None, 0.0 if gauss is None else gauss)


def python_load(raw: bytes) -> None:
    fields = struct.unpack(PY_FMT, raw)
    words, has_gauss, gauss = fields[:PY_WORDS], fields[PY_WORDS], fields[PY_WORDS + 1]
    random.setstate((3, tuple(words), gauss if has_gauss else None))


@functools.cache
def python_reader() -> Callable[[], bytes] | None:
    """A fast reader of ``random``'s global generator giving ``python_save_public``'s bytes
    (probed once per process: a forked child's generator sits at the same address)."""
    if sys.byteorder != "little":
        return None
    inst = random._inst                           # the generator behind random.random() & co.
    size = type(inst).__mro__[-2].__basicsize__   # _random.Random's C struct
    probes = []
    for seed in (1, 2, 3):
        p = random.Random(seed)
        for _ in range(seed * 7):
            p.random()                            # an index other than the seed's
        _, words, _ = p.getstate()
        probes.append((p, struct.pack("<624I", *words[:624]), struct.pack("<I", words[624])))
    state_at = _offset([(p, w) for p, w, _ in probes], size, 4)
    index_at = _offset([(p, i) for p, _, i in probes], size, 4)
    if state_at is None or index_at is None or index_at + 4 != state_at:
        return None                               # CPython's is ``int index; uint32_t state[624]``
    where = id(inst) + index_at

    def read() -> bytes:
        mem = ctypes.string_at(where, 4 + _MT_BYTES)
        g = inst.gauss_next
        return mem[4:] + mem[:4] + struct.pack("<?d", g is not None, 0.0 if g is None else g)

    if read() != python_save_public():
        return None
    return read


# ----------------------------------------------------------------------------------------- numpy
def numpy_save_public(np: Any) -> bytes:
    return numpy_save_public_of(np.random.mtrand._rand)


def numpy_save_public_of(rs: Any) -> bytes:
    # The state as a dict: no 624-int tuple (the legacy tuple form is slower still)
    st = rs.get_state(legacy=False)
    return st["state"]["key"].tobytes() + struct.pack("<Iid", st["state"]["pos"], st["has_gauss"], st["gauss"])


def numpy_load(np: Any, raw: bytes) -> None:
    key = np.frombuffer(raw[:_MT_BYTES], dtype=np.uint32).copy()
    pos, has_gauss, gauss = struct.unpack("<Iid", raw[_MT_BYTES:])
    np.random.set_state({"bit_generator": "MT19937", "state": {"key": key, "pos": pos},
                         "has_gauss": has_gauss, "gauss": gauss})


@functools.cache
def numpy_reader(np: Any) -> Callable[[], bytes] | None:
    """A fast reader of numpy's legacy global generator giving ``numpy_save_public``'s bytes
    (probed once per process)."""
    if sys.byteorder != "little":
        return None
    try:
        key = (np.arange(624, dtype=np.uint64) * 2654435761 % (1 << 32)).astype(np.uint32)   # distinctive words

        def probe(has_gauss: int, gauss: float):
            p = np.random.RandomState(0)
            p.set_state({"bit_generator": "MT19937", "state": {"key": key, "pos": 17},
                         "has_gauss": has_gauss, "gauss": gauss})
            return p

        size = type(np.random.mtrand._rand).__basicsize__
        states = ((0x5A5A5A5A, 1.2345678901234567e-300), (0x3C3C3C3C, -9.87654321e+200), (0x0F0F0F0F, 3.25e-7))
        probes = [(probe(h, g), struct.pack("<i", h), struct.pack("<d", g)) for h, g in states]
        gauss_at = _offset([(p, g) for p, _, g in probes], size, 8)
        flag_at = _offset([(p, h) for p, h, _ in probes], size, 4)
        # numpy's ``aug_bitgen_t``: ``int has_gauss`` then ``double gauss``, 8-aligned
        if gauss_at is None or flag_at is None or not flag_at + 4 <= gauss_at <= flag_at + 8:
            return None

        def reader_of(rs) -> Callable[[], bytes]:
            address = rs._bit_generator.ctypes.state_address

            def read() -> bytes:
                mem = ctypes.string_at(id(rs), size)
                return ctypes.string_at(address, _MT_BYTES + 4) + mem[flag_at:flag_at + 4] + mem[gauss_at:gauss_at + 8]
            return read

        # checked on generators in both Gaussian states, then on the real one
        for h, g in ((1, 0.625), (0, -2.5)):
            p = probe(h, g)
            if reader_of(p)() != numpy_save_public_of(p):
                return None
        read = reader_of(np.random.mtrand._rand)
    except (AttributeError, TypeError, ValueError):
        return None
    return read if read() == numpy_save_public(np) else None


__all__ = ["PY_FMT", "NP_FMT", "python_load", "python_reader", "python_save_public", "numpy_reader", "numpy_save_public",
           "numpy_load"]
