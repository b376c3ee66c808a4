"""Memory pattern test: write known patterns into a device buffer, read them back, compare exactly.

Patterns over a buffer of 32-bit words (``nbytes`` rounded down to whole words):

    zeros          every bit 0
    ones           every bit 1
    walking-ones   32 passes; pass b writes 1 << b into every word (each bit alone at 1)
    walking-zeros  32 passes; pass b writes ~(1 << b) (each bit alone at 0)
    address        word i holds i (mod 2**31): catches address-line faults and aliasing, where
                   two addresses land on the same cell and the later write shows at both
    address-inv    word i holds ~i: every bit of the address pattern in its other state

Every word is compared with what was written (exact integer equality: a fill pass checks that
the buffer's minimum and maximum both equal the value, which reads it once; only a failing pass
compares word by word). The result counts wrong words per pattern and describes the first one
(offset, written, read, which bits flipped).
Large buffers are written and checked in chunks so the expected values never need a second
buffer of the same size.

Fault injection (documented, for testing the check itself): ``inject="bitflip"`` flips bit 13 of
the word in the middle of the buffer after the first write of each pattern and before it is read
back, as a cell losing its charge would: one wrong word per pattern, through every comparison path.
"""
from __future__ import annotations

import time

from hotspare.errors import ConfigError
from hotspare.health.checks.result import CheckResult, check_stop

PATTERNS = ("zeros", "ones", "walking-ones", "walking-zeros", "address", "address-inv")
FLIP_BIT = 13
INJECTIONS = ("bitflip",)
CHUNK_WORDS = 1 << 24          # 64 MiB of int32 per chunk for the address patterns
FREE_SHARE = 0.8               # on a GPU, never ask for more than this share of the free memory


def _i32(v: int) -> int:
    """The int32 whose bits are the low 32 bits of ``v``."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def memory_test(device: str, torch_device: str = "cpu", *, nbytes: int, inject: str | None = None,
                patterns: tuple[str, ...] = PATTERNS, stop=None) -> CheckResult:
    import torch

    words = nbytes // 4
    if words < 2:
        raise ConfigError(f"memory test needs at least 8 bytes, got nbytes={nbytes}")
    if inject not in (None, *INJECTIONS):
        raise ConfigError(f"memory test injection {inject!r} unknown; use one of {', '.join(INJECTIONS)}")
    unknown = set(patterns) - set(PATTERNS)
    if unknown:
        raise ConfigError(f"unknown memory pattern(s) {sorted(unknown)}; choose from {', '.join(PATTERNS)}")
    t_begin = time.perf_counter()
    dev = torch.device(torch_device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    capped = ""
    if dev.type == "cuda":      # a size preset larger than this GPU: test what it can hold
        free, _total = torch.cuda.mem_get_info(dev)
        limit = int(free * FREE_SHARE) // 4
        if words > limit:
            capped = f" (capped from {words * 4 / 2**20:.0f} MiB to {FREE_SHARE:.0%} of the free memory)"
            words = limit
    buf = torch.empty(words, dtype=torch.int32, device=dev)
    errors: dict[str, int] = {}
    first: tuple | None = None
    passes = 0

    def record(pattern: str, wrong: torch.Tensor, offset: int, expected):
        nonlocal first
        n = int(wrong.sum())
        if not n:
            return
        errors[pattern] = errors.get(pattern, 0) + n
        if first is None:
            k = int(torch.nonzero(wrong)[0])
            want = int(expected if isinstance(expected, int) else expected[k])
            got = int(buf[offset + k])
            first = (pattern, (offset + k) * 4, want & 0xFFFFFFFF, got & 0xFFFFFFFF)

    flipped: set[str] = set()

    def maybe_flip(pattern: str):
        if inject == "bitflip" and pattern not in flipped:
            flipped.add(pattern)
            mid = words // 2
            buf[mid] = buf[mid] ^ (1 << FLIP_BIT)

    def fill_pass(pattern: str, value: int):
        nonlocal passes
        check_stop(stop, "memory test")
        v = _i32(value)
        buf.fill_(v)
        sync()
        maybe_flip(pattern)
        lo, hi = torch.aminmax(buf)             # one read pass; exact for integers
        if int(lo) != v or int(hi) != v:
            record(pattern, buf != v, 0, v)     # slow path only when something is wrong
        passes += 1

    def address_pass(pattern: str, invert: bool):
        nonlocal passes
        check_stop(stop, "memory test")
        for start in range(0, words, CHUNK_WORDS):
            end = min(words, start + CHUNK_WORDS)
            idx = torch.arange(start, end, dtype=torch.int64, device=dev) & 0x7FFFFFFF
            buf[start:end] = (~idx if invert else idx).to(torch.int32)
        sync()
        maybe_flip(pattern)
        for start in range(0, words, CHUNK_WORDS):
            end = min(words, start + CHUNK_WORDS)
            idx = torch.arange(start, end, dtype=torch.int64, device=dev) & 0x7FFFFFFF
            expected = (~idx if invert else idx).to(torch.int32)
            if not torch.equal(buf[start:end], expected):
                record(pattern, buf[start:end] != expected, start, expected)
        passes += 1

    for p in patterns:
        if p == "zeros":
            fill_pass(p, 0)
        elif p == "ones":
            fill_pass(p, 0xFFFFFFFF)
        elif p == "walking-ones":
            for bit in range(32):
                fill_pass(p, 1 << bit)
        elif p == "walking-zeros":
            for bit in range(32):
                fill_pass(p, ~(1 << bit))
        else:
            address_pass(p, invert=(p == "address-inv"))
    sync()
    elapsed = time.perf_counter() - t_begin
    total = sum(errors.values())
    m = {"bytes": words * 4, "patterns": list(patterns), "passes": passes, "wrong_words": total,
         "wrong_by_pattern": errors, "gb_per_s": round(2 * words * 4 * passes / elapsed / 1e9, 3),
         "device": str(dev)}
    if total:
        pattern, offset, want, got = first
        flipped = [b for b in range(32) if (want ^ got) >> b & 1]
        detail = (f"{total} wrong word(s) in {words * 4 / 2**20:.0f} MiB; first in pattern {pattern} "
                  f"at byte offset {offset}: wrote 0x{want:08x}, read 0x{got:08x} "
                  f"(bit{'s' if len(flipped) > 1 else ''} {', '.join(map(str, flipped))} flipped)")
        return CheckResult("memory", device, False, detail, m, elapsed)
    detail = (f"{passes} pattern passes over {words * 4 / 2**20:.0f} MiB{capped} "
              f"({', '.join(patterns)}): every word read back exactly as written")
    return CheckResult("memory", device, True, detail, m, elapsed)
