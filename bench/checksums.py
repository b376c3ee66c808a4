"""What a buddy snapshot's checksum and packing cost per byte, on one core (transfer/buddy.py).

    python bench/checksums.py [--mb 12]

Candidates: XXH3-64 (the ``xxhash`` package, what the buddy snapshots use), and from the
standard library sha256 (with the CPU's SHA instructions where it has them), blake2b, sha1,
md5, zlib's CRC-32 (what they used before) and Adler-32; and the copy into a fresh buffer
against one into a reused buffer (page faults). Prints GB/s for each.
"""
from __future__ import annotations

import argparse
import hashlib
import time
import zlib

import torch
import xxhash


def rate(fn, nbytes: int, repeat: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / sorted(times)[len(times) // 2] / 1e9     # the median: page faults count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=12.0, help="buffer size in MB (default 12: a 1M-parameter AdamW shard)")
    args = p.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(int(args.mb * 2**20) // 4).view(torch.uint8)
    mv, n = x.numpy().data, x.numel()
    reused = torch.empty_like(x)
    cases = {
        "xxhash.xxh3_64": lambda: xxhash.xxh3_64_intdigest(mv),
        "sha256": lambda: hashlib.sha256(mv).digest(),
        "blake2b": lambda: hashlib.blake2b(mv).digest(),
        "sha1": lambda: hashlib.sha1(mv).digest(),
        "md5": lambda: hashlib.md5(mv).digest(),
        "zlib.crc32": lambda: zlib.crc32(mv),
        "zlib.adler32": lambda: zlib.adler32(mv),
        "copy into a fresh buffer": lambda: torch.empty_like(x).copy_(x),
        "copy into a reused buffer": lambda: reused.copy_(x),
    }
    print(f"{n / 2**20:.1f} MB, one thread")
    for name, fn in cases.items():
        print(f"  {name:28s} {rate(fn, n):6.2f} GB/s")


if __name__ == "__main__":
    main()
