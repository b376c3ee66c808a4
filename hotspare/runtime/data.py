"""Determinism helpers: everything random in a step is a pure function of (seed, rank, step).

A replacement rank that resumes at step k must draw the same batch and the same dropout masks
its predecessor would have drawn. Seeding from the step (not from a stream advanced over the
run) makes that true without moving any RNG state or sampler position between processes.
"""
from __future__ import annotations

import hashlib
import random
import struct

import torch


def step_seed(seed: int, rank: int, step: int, stream: int = 0) -> int:
    """A 63-bit seed derived from (seed, rank, step, stream) by sha256: no correlations
    between neighbouring steps or ranks, identical on every machine and Python version."""
    digest = hashlib.sha256(struct.pack("<4q", seed, rank, step, stream)).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seed_step(seed: int, rank: int, step: int) -> torch.Generator:
    """Seed torch's and Python's global RNGs for this (rank, step); returns a private generator
    seeded from the same triple for code that prefers an explicit generator."""
    s = step_seed(seed, rank, step)
    _seed_torch(s)
    random.seed(s)
    try:
        import numpy as np
        np.random.seed(s % (1 << 32))
    except ImportError:  # pragma: no cover
        pass
    g = torch.Generator()
    g.manual_seed(step_seed(seed, rank, step, stream=1))
    return g


def _seed_torch(s: int) -> None:
    """``torch.manual_seed``, minus its cost on CPU-only machines: there it also queues a lazy
    CUDA seeding with a formatted stack trace, ~0.3 ms on every step for nothing."""
    if _CPU_ONLY:
        torch.default_generator.manual_seed(s)
    else:
        torch.manual_seed(s)


_CPU_ONLY = not (torch.cuda.is_available() or torch.backends.mps.is_available()
                 or (hasattr(torch, "xpu") and torch.xpu.is_available()))


def batch_indices(step: int, rank: int, world_size: int, batch_size: int, dataset_len: int,
                  seed: int = 0) -> torch.Tensor:
    """The dataset indices of one rank's batch at ``step``: a resumable distributed sampler.

    Samples are consumed in epochs; each epoch is a fresh permutation seeded by (seed, epoch),
    and global sample number ``(step * world_size + rank) * batch_size + j`` picks its position
    in it. So the data position is a function of the step: nothing to save, nothing to send."""
    if dataset_len <= 0 or batch_size <= 0:
        raise ValueError("batch_indices needs dataset_len > 0 and batch_size > 0")
    first = (step * world_size + rank) * batch_size
    out = torch.empty(batch_size, dtype=torch.long)
    for j in range(batch_size):
        epoch, pos = divmod(first + j, dataset_len)
        out[j] = _permutation(seed, epoch, dataset_len)[pos]
    return out


_perm_cache: dict[tuple[int, int, int], torch.Tensor] = {}


def _permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    key = (seed, epoch, n)
    if key not in _perm_cache:
        if len(_perm_cache) > 4:
            _perm_cache.clear()
        g = torch.Generator()
        g.manual_seed(step_seed(seed, -1, epoch, stream=2))
        _perm_cache[key] = torch.randperm(n, generator=g)
    return _perm_cache[key]
