"""Snapshots of device state in host memory, copied while the device keeps computing.

Peer replication needs a copy of the committed state off the GPU; a synchronous
``tensor.cpu()`` stalls the training stream for the whole copy. Here the copies run on a side
stream into pinned host buffers, as asynchronous DMA, so they overlap with the next step's
forward and backward (which read the parameters but never write them)::

    snap = DeviceSnapshot()
    ...optimizer.step()                    # the state of step N is final
    snap.start(tensors)                    # side stream waits for step N, then copies
    ...forward(), backward()               # overlap: compute runs, the DMA engine copies
    snap.before_write()                    # the next optimizer.step queues behind the copy
    optimizer.step()                       # (no CPU wait: stream order does it)
    snap.wait(); snap.host                 # the host copy of step N, e.g. to send to a peer

``restore(tensors)`` copies the host buffers back (host to device). Buffers are allocated
once and reused by every later snapshot of the same shapes: pinned allocations cost
milliseconds per MB (``cudaHostAlloc`` maps and locks pages), so allocating per snapshot would
cost more than the copy. Memory: one host copy of the snapshotted state, pinned.

On CPU tensors the same calls are plain copies into reused buffers (there is no stream to
overlap with); the logic is the same, which is what the CPU tests check.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch


@dataclass
class SnapshotStats:
    bytes: int = 0
    seconds: float = 0.0          # device time of the copies (CUDA events), or wall time on CPU
    allocations: int = 0          # host buffers allocated by this snapshot (0 once warm)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


def _device_of(tensors: list[torch.Tensor]) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"a snapshot copies tensors of one device, got {sorted(map(str, devices))}")
    return next(iter(devices)) if devices else torch.device("cpu")


class DeviceSnapshot:
    """Copies of a fixed list of tensors in reused host buffers; CUDA copies are asynchronous."""

    def __init__(self) -> None:
        self.host: list[torch.Tensor] = []
        self._device: torch.device | None = None
        self._stream = None                  # torch.cuda.Stream, created on first CUDA use
        self._begin = self._end = None       # torch.cuda.Event pair of the copies in flight
        self._t0 = 0.0
        self.stats = SnapshotStats()
        self._pending = False

    @property
    def cuda(self) -> bool:
        return self._device is not None and self._device.type == "cuda"

    def _buffers(self, tensors: list[torch.Tensor]) -> int:
        """Make ``self.host`` match ``tensors`` (shape, dtype), reusing what fits; returns how
        many buffers were allocated."""
        pin = tensors[0].is_cuda if tensors else False
        allocated = 0
        if len(self.host) > len(tensors):
            del self.host[len(tensors):]
        for i, t in enumerate(tensors):
            buf = self.host[i] if i < len(self.host) else None
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.is_pinned() != pin:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                allocated += 1
                if i < len(self.host):
                    self.host[i] = buf
                else:
                    self.host.append(buf)
        return allocated

    def start(self, tensors: list[torch.Tensor]) -> None:
        """Begin copying ``tensors`` into the host buffers. On CUDA the copies wait (on the GPU)
        for the work already queued on the current stream, then run on a side stream; the caller
        must not write ``tensors`` until ``before_write()`` or ``wait()``."""
        if self._pending:
            self.wait()
        device = _device_of(tensors)
        self._device = device
        allocated = self._buffers(tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.stats = SnapshotStats(bytes=nbytes, allocations=allocated)
        if device.type != "cuda":
            t0 = time.perf_counter()
            for buf, t in zip(self.host, tensors):
                buf.copy_(t)
            self.stats.seconds = time.perf_counter() - t0
            return
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        producer = torch.cuda.current_stream(device)
        self._begin = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._stream.wait_stream(producer)          # copy the state as of now, not before
        with torch.cuda.stream(self._stream):
            self._begin.record(self._stream)
            for buf, t in zip(self.host, tensors):
                buf.copy_(t, non_blocking=True)     # pinned destination: a true async DMA
                # the caching allocator must not hand t's memory to another tensor before the
                # copy has read it, even if the caller drops t meanwhile
                t.record_stream(self._stream)
            self._end.record(self._stream)
        self._pending = True

    @property
    def ready(self) -> bool:
        """Has the copy finished? Never blocks."""
        return not self._pending or self._end.query()

    def before_write(self) -> None:
        """Make the current stream wait for the copy (on the GPU, no CPU wait), so kernels
        queued from now on (the next optimizer step) cannot overwrite state not yet copied."""
        if self._pending:
            torch.cuda.current_stream(self._device).wait_event(self._end)

    def wait(self) -> SnapshotStats:
        """Block until the host buffers hold the snapshot; returns its stats."""
        if self._pending:
            self._end.synchronize()
            self.stats.seconds = self._begin.elapsed_time(self._end) / 1e3
            self._pending = False
        return self.stats

    def restore(self, tensors: list[torch.Tensor]) -> SnapshotStats:
        """Copy the host buffers back into ``tensors`` (same shapes and dtypes), on the
        current stream, so work queued after it sees the restored state. Returns its stats
        (on CUDA, after waiting for the copy)."""
        self.wait()
        if len(tensors) != len(self.host):
            raise ValueError(f"restore into {len(tensors)} tensors, the snapshot holds {len(self.host)}")
        for buf, t in zip(self.host, tensors):
            if buf.shape != t.shape or buf.dtype != t.dtype:
                raise ValueError(f"restore: snapshot {tuple(buf.shape)} {buf.dtype} does not fit "
                                 f"{tuple(t.shape)} {t.dtype}")
        device = _device_of(tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if device.type != "cuda":
            t0 = time.perf_counter()
            for buf, t in zip(self.host, tensors):
                t.copy_(buf)
            return SnapshotStats(bytes=nbytes, seconds=time.perf_counter() - t0)
        stream = torch.cuda.current_stream(device)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        for buf, t in zip(self.host, tensors):
            t.copy_(buf, non_blocking=True)
        end.record(stream)
        end.synchronize()
        return SnapshotStats(bytes=nbytes, seconds=begin.elapsed_time(end) / 1e3)

    def digest(self) -> str:
        """SHA-256 of the snapshot's bytes, in order (waits for the copy)."""
        self.wait()
        return digest_of(self.host)


def digest_of(tensors: list[torch.Tensor]) -> str:
    """SHA-256 over the raw bytes of ``tensors`` in order (device tensors are copied to the host
    first): two lists with equal digests hold the same bits."""
    h = hashlib.sha256()
    for t in tensors:
        c = t.detach().contiguous()
        if c.device.type != "cpu":
            c = c.cpu()
        h.update(c.reshape(-1).view(torch.uint8).numpy())      # hashed in place, no bytes copy
    return h.hexdigest()
