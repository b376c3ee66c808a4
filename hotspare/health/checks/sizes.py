"""How big each check runs, per device kind, stage and ``--size``.

CPU sizes are for one core per device and keep ``hotspare check admission`` (small) to seconds;
GPU sizes load an H100-class device for a meaningful time without filling its memory.
"""
from __future__ import annotations

import dataclasses

from hotspare.errors import ConfigError

MiB = 1 << 20
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Sizes:
    matmul_n: int         # burn-in: C = A @ B with n x n float32 matrices
    burn_reps: int        # timed repetitions, each checked against the float64 reference
    burn_seconds: float   # ... and at least this long (quarantine's longer burn-in)
    mem_bytes: int        # memory pattern test buffer
    bw_bytes: int         # all-reduce buffer of the collective bandwidth test
    bw_iters: int         # timed all-reduces


ADMISSION = {
    ("cpu", "small"): Sizes(512, 10, 0.0, 4 * MiB, 4 * MiB, 10),
    ("cpu", "full"): Sizes(1024, 20, 0.0, 128 * MiB, 64 * MiB, 10),
    ("gpu", "small"): Sizes(4096, 20, 0.0, 1 * GiB, 256 * MiB, 10),
    ("gpu", "full"): Sizes(8192, 50, 0.0, 8 * GiB, 1 * GiB, 20),
}
QUARANTINE = {
    ("cpu", "small"): Sizes(512, 10, 1.0, 16 * MiB, 0, 0),
    ("cpu", "full"): Sizes(1024, 20, 30.0, 512 * MiB, 0, 0),
    ("gpu", "small"): Sizes(8192, 20, 30.0, 4 * GiB, 0, 0),
    ("gpu", "full"): Sizes(8192, 100, 300.0, 32 * GiB, 0, 0),
}
SIZE_NAMES = ("small", "full")


def sizes_for(stage: str, kind: str, size: str) -> Sizes:
    table = {"admission": ADMISSION, "quarantine": QUARANTINE}.get(stage)
    if table is None:
        raise ConfigError(f"unknown check stage {stage!r}; use admission or quarantine")
    if (kind, size) not in table:
        raise ConfigError(f"no sizes for {kind!r} devices at size {size!r}; kind is cpu or gpu, "
                          f"size one of {', '.join(SIZE_NAMES)}")
    return table[(kind, size)]
