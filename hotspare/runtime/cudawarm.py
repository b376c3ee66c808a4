"""A warm spare's CUDA context: created while the spare waits, so taking over costs no CUDA start-up.

A spare is forked from the zygote, which must keep CUDA uninitialised (a CUDA context does not
survive ``fork``: see ``agent/zygote.py``). So the context is made after the fork, in the spare
itself, once it knows its device and before any work is asked of it: the runtime calls
:func:`warm_cuda` while the spare waits for a generation. It

1. initialises CUDA (``torch.cuda.init()``: driver, primary context on the device; typically
   the largest part, hundreds of ms to seconds),
2. binds the device (``torch.cuda.set_device``),
3. runs one small matmul in each of bfloat16 and float32, which loads cuBLAS, creates its handle
   and workspace and loads those kernels (with lazy module loading, the default since CUDA 12,
   kernels load on first use),
4. optionally reserves ``pool_bytes`` in PyTorch's caching allocator: one block is allocated and
   freed; the allocator keeps the segment and splits it for the state the spare later receives,
   so no ``cudaMalloc`` runs during the takeover. The memory stays reserved by this process.

Everything is timed; on a machine without CUDA it does nothing and says why. It needs nothing
from the runtime and can be called from any thread before the spare's first CUDA use.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass


@dataclass
class CudaWarmth:
    device: str | None = None
    init_s: float = 0.0            # torch.cuda.init(): driver and context
    set_device_s: float = 0.0
    libraries_s: float = 0.0       # first cuBLAS matmuls (bf16, fp32)
    pool_s: float = 0.0            # reserving the memory pool
    pool_bytes: int = 0            # reserved by the caching allocator afterwards
    total_s: float = 0.0
    skipped: str = ""              # why nothing was done ("" when warmed)

    def to_dict(self) -> dict:
        return asdict(self)


def warm_cuda(device: "str | int | None" = None, pool_bytes: int = 0) -> CudaWarmth:
    """Create this process's CUDA context on ``device`` (default: the current one) and, if
    ``pool_bytes`` > 0, reserve that much device memory in the caching allocator. No-op (with
    ``skipped`` saying why) where CUDA is not available."""
    import torch

    if pool_bytes < 0:
        raise ValueError(f"pool_bytes must be >= 0, got {pool_bytes}")
    if not torch.cuda.is_available():
        return CudaWarmth(skipped="CUDA is not available here (CPU build or no GPU): nothing to warm")
    t_begin = time.perf_counter()
    out = CudaWarmth()
    t0 = time.perf_counter()
    torch.cuda.init()
    out.init_s = time.perf_counter() - t0
    dev = torch.device("cuda", torch.cuda.current_device() if device is None else
                       (device if isinstance(device, int) else torch.device(device).index))
    t0 = time.perf_counter()
    torch.cuda.set_device(dev)
    torch.cuda.synchronize(dev)          # the primary context is really live from here on
    out.set_device_s = time.perf_counter() - t0
    out.device = str(dev)
    t0 = time.perf_counter()
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.ones(64, 64, dtype=dtype, device=dev)
        (a @ a).sum().item()
    out.libraries_s = time.perf_counter() - t0
    if pool_bytes:
        t0 = time.perf_counter()
        # allocated (one cudaMalloc) and dropped at once: freed to the cache, not to the driver
        torch.empty(pool_bytes, dtype=torch.uint8, device=dev)
        torch.cuda.synchronize(dev)
        out.pool_s = time.perf_counter() - t0
    out.pool_bytes = torch.cuda.memory_reserved(dev)
    out.total_s = time.perf_counter() - t_begin
    return out
