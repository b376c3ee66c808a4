"""One process group per generation, and a real way to abort it.

Each generation gets a fresh default process group under its own store prefix (``gen<N>/``), so
nothing of a broken generation can leak into the next one.

Aborting gloo: ``ProcessGroupGloo.abort()`` and ``shutdown()`` do not wake a thread blocked in a
collective, and the sockets of a group stay open while *any* Python object still references it
(DDP's reducer keeps the last bucket futures, a traceback keeps a frame...). A survivor that keeps
its group open blocks its peers until the collective timeout (30 minutes by default). So the
generation records the TCP connections its backend opened and, on abort, shuts them down at the
OS level (``shutdown(SHUT_RDWR)`` on a dup of each descriptor). Every blocked collective on this
rank fails at once, and the peers see "connection closed" a few milliseconds later: the cascade
frees every survivor. Listening sockets are left alone (gloo's listener thread aborts the whole
process if its accept() fails). On NCCL the same seam calls ``ncclCommAbort`` through
``torch.distributed``'s abort.
"""
from __future__ import annotations

import datetime
import os
import socket
import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, ProcessGroupGloo


def _socket_fds() -> dict[int, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out[int(fd)] = link
    return out


def _shutdown_connected(fds: dict[int, str]) -> int:
    """Shut down every still-open connected TCP socket among ``fds``; returns how many."""
    n = 0
    for fd, link in fds.items():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != link:
                continue  # closed and the number reused: not ours any more
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM:
                s.getpeername()           # raises for listening sockets: leave those alone
                s.shutdown(socket.SHUT_RDWR)
                n += 1
        except OSError:
            pass
        finally:
            s.close()                     # closes our dup only
    return n


class GenerationGroup:
    """The default process group of one generation, with a reliable ``abort``."""

    def __init__(self, store: dist.Store, gen: int, rank: int, world: int, prefix: str,
                 backend: str = "gloo", timeout_s: float = 120.0):
        self.gen, self.rank, self.world, self.backend = gen, rank, world, backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.PrefixStore(prefix, store)
        self._lock = threading.Lock()
        self._fds: dict[int, str] = {}
        self.aborted = False
        self.subgroups: list[dist.ProcessGroup] = []
        with self._recording():
            dist.init_process_group(backend, store=self._store, rank=rank, world_size=world,
                                    timeout=self.timeout)

    @property
    def store(self) -> dist.Store:
        return self._store

    @contextmanager
    def _recording(self):
        before = _socket_fds()
        try:
            yield
        finally:
            after = _socket_fds()
            with self._lock:
                self._fds.update({fd: l for fd, l in after.items() if before.get(fd) != l})

    def new_subgroup(self, ranks: list[int]) -> dist.ProcessGroup | None:
        """A subgroup of this generation; every rank must call it with the same list."""
        with self._recording():
            pg = dist.new_group(ranks=ranks, backend=self.backend, timeout=self.timeout)
        if self.rank not in ranks:
            return None
        if pg is not None:
            self.subgroups.append(pg)
        return pg

    def abort(self) -> None:
        """Make every collective of this generation fail now, here and (by cascade) on peers.

        Safe to call from any thread, any number of times."""
        with self._lock:
            self.aborted = True
            fds = dict(self._fds)
        if self.backend == "nccl":  # pragma: no cover - needs GPUs
            from torch.distributed.distributed_c10d import _abort_process_group
            _abort_process_group()
            return
        _shutdown_connected(fds)

    def destroy(self) -> None:
        self.abort()
        for pg in self.subgroups:
            try:
                dist.destroy_process_group(pg)
            except Exception:
                pass
        self.subgroups.clear()
        if dist.is_initialized():
            dist.destroy_process_group()


def local_process_group() -> ProcessGroup:
    """A one-rank gloo group for DDP's own bookkeeping.

    hotspare's DDP does its gradient reduction in a comm hook on the *current* generation's group;
    DDP itself gets a group of one so that building it on a spare needs no peers (no parameter
    broadcast, no shape check across ranks) and no collective of DDP's survives a generation."""
    store = dist.HashStore()
    opts = ProcessGroupGloo._Options()
    opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    backend = ProcessGroupGloo(store, 0, 1, opts)
    pg = ProcessGroup(store, 0, 1)
    pg._set_default_backend(ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    return pg
