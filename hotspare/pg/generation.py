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
process if its accept() fails).

Aborting NCCL (``backend="nccl"``): the group is bound to one CUDA device (``device``, e.g. the
agent's slot or ``cuda:LOCAL_RANK``) and its communicator is created eagerly and non-blocking
(``pg/nccl.py``), so the rendezvous goes through the abortable store and a dead peer is seen in
``connect``. ``abort()`` calls ``ProcessGroup.abort()`` on this generation's group object, which
runs ``ncclCommAbort`` on its communicators: kernels waiting for a dead peer end, pending works
raise, the process and its CUDA context live on. It touches no torch.distributed global, so any
thread may call it; ``destroy()``, in the owning thread, then drops the group from
torch.distributed's registry (``_abort_process_group``), so the next generation can be built in
the same process. The watchdog's collective timeout is short (60 s; ``pg/nccl.py``) and with
``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` it aborts instead of killing the process. On NCCL the
works that ``allreduce`` and ``all_gather`` return are ``SupervisedWork``: their ``wait()`` is the
generation's bounded :meth:`GenerationGroup.wait` (NCCL's own ``work.wait()`` does not block the
CPU), so the runtime's ``work.wait()`` sees a hang on its own deadline and aborts the generation;
gloo's works are returned as they are. Verified on CPU only so far: docs/GPU.md says what a GPU
run has to confirm.
"""
from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from hotspare.errors import PeerFailure
from hotspare.pg import nccl

NCCL_ABORT_DEADLINE_S = 10.0


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


class AbortableStore(dist.Store):
    """A store whose blocking reads give up as soon as the generation is aborted.

    Forming a group waits in the store for every member's address; if a member dies meanwhile,
    plain TCPStore reads would wait out their whole timeout. Reads here poll instead, and raise
    ``PeerFailure`` the moment ``abort`` is set."""

    def __init__(self, inner: dist.Store, aborted: "threading.Event", timeout_s: float):
        super().__init__()
        self._inner, self._aborted, self._timeout_s = inner, aborted, timeout_s

    def _await(self, keys: list[str]) -> None:
        delay, deadline = 0.001, time.monotonic() + self._timeout_s
        while not self._inner.check(keys):
            if self._aborted.is_set():
                raise PeerFailure("generation aborted while forming")
            if time.monotonic() > deadline:
                raise PeerFailure(f"timed out after {self._timeout_s:.0f} s waiting for {keys} "
                                  "while forming the generation")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def get(self, key):
        self._await([key])
        return self._inner.get(key)

    def wait(self, keys, timeout=None):
        self._await(list(keys))

    def set(self, key, value):
        return self._inner.set(key, value)

    def add(self, key, amount):
        return self._inner.add(key, amount)

    def check(self, keys):
        return self._inner.check(keys)

    def compare_set(self, key, expected, desired):
        return self._inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self._inner.delete_key(key)

    def num_keys(self):
        return self._inner.num_keys()

    def set_timeout(self, timeout):
        return self._inner.set_timeout(timeout)

    @property
    def timeout(self):
        return self._inner.timeout


class GenerationGroup:
    """The default process group of one generation, with a reliable ``abort``.

    Create it, publish it where an abort can reach it, then ``connect()``: an abort during the
    rendezvous makes ``connect`` raise ``PeerFailure`` instead of waiting for a dead member."""

    def __init__(self, store: dist.Store, gen: int, rank: int, world: int, prefix: str,
                 backend: str = "gloo", join_timeout_s: float = 5.0, timeout_s: float | None = None,
                 *, device: "str | int | torch.device | None" = None):
        """``backend``: "gloo" (CPU tensors) or "nccl" (CUDA tensors on ``device``, e.g.
        "cuda:0"; default ``cuda:LOCAL_RANK``). ``timeout_s``: the collective timeout (default
        30 minutes for gloo, 60 s for NCCL: see ``pg/nccl.py``)."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.gen, self.rank, self.world, self.backend = gen, rank, world, backend
        self.device: torch.device | None = None
        if backend == "nccl":
            local = os.environ.get("LOCAL_RANK")
            self.device = nccl.cuda_device(device, int(local) if local is not None else None)
        # Forming the group gets a short timeout: gloo retries connecting to a member that died
        # after publishing its address until this runs out, and an abort cannot cut that short.
        # gloo's collectives then keep torch's 30-minute default: hangs are found by heartbeats
        # and fenced long before that (see policy/hang.py); it is only a last line of defence.
        self.join_timeout = datetime.timedelta(seconds=join_timeout_s)
        self.timeout = nccl.collective_timeout(timeout_s, backend)
        self._aborted = threading.Event()
        self._store = AbortableStore(dist.PrefixStore(prefix, store), self._aborted, join_timeout_s)
        self._lock = threading.Lock()
        self._fds: dict[int, str] = {}
        self._adopted: dict[int, str] = {}      # hotspare's own connections of this generation (any backend)
        self._pg: dist.ProcessGroup | None = None
        self._sum = dist.AllreduceOptions()            # reduceOp SUM
        self._abort_thread: threading.Thread | None = None
        self.abort_deadline_s = NCCL_ABORT_DEADLINE_S

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def connect(self) -> None:
        # torch names the default group after a process-wide counter that it resets only when a
        # WORLD group is destroyed; a rendezvous that failed half-way leaves it advanced, and
        # the gloo keys of this rank would then never meet its peers'. Every generation starts
        # from the same name (its store prefix keeps generations apart).
        dist.distributed_c10d._world.group_count = 0
        if self.backend == "nccl":
            self._connect_nccl()
            return
        with self._recording():
            dist.init_process_group(self.backend, store=self._store, rank=self.rank,
                                    world_size=self.world, timeout=self.join_timeout)
        self._pg = dist.distributed_c10d._get_default_group()
        self._pg._get_backend(torch.device("cpu")).set_timeout(self.timeout)

    def _connect_nccl(self) -> None:
        if not dist.is_nccl_available():
            raise ValueError("backend='nccl' needs a torch built with NCCL (a CUDA build); "
                             "this one has none: use backend='gloo'")
        nccl.apply_nccl_environment(os.environ, self.join_timeout.total_seconds())
        torch.cuda.set_device(self.device)
        # device_id makes the communicator eager: the ncclUniqueId exchange happens here,
        # through the abortable store, instead of inside the first collective.
        dist.init_process_group("nccl", store=self._store, rank=self.rank, world_size=self.world,
                                timeout=self.timeout, device_id=self.device,
                                pg_options=nccl.nccl_options(self.timeout, nonblocking=True))
        pg = dist.distributed_c10d._get_default_group()
        with self._lock:
            self._pg = pg
            aborted = self._aborted.is_set()
        if aborted:          # an abort that came while forming had no communicator to reach
            self._abort_nccl(pg)

    def allreduce(self, tensor: torch.Tensor) -> "dist.Work | SupervisedWork":
        """Start a sum all-reduce of ``tensor``, in place, on this generation's group: the group's
        own call, without torch.distributed's per-call Python checks (the gradient buckets).
        On NCCL the tensor must be on ``self.device``, and the work comes back supervised
        (``SupervisedWork``: its ``wait()`` is :meth:`wait`)."""
        self._refuse_if_aborted()
        return self._supervised(self._pg.allreduce([tensor], self._sum))

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> "dist.Work | SupervisedWork":
        """Start gathering every rank's ``tensor`` (all the same size) into ``out``, rank by rank."""
        self._refuse_if_aborted()
        return self._supervised(self._pg._allgather_base(out, tensor))

    def _supervised(self, work: dist.Work) -> "dist.Work | SupervisedWork":
        # gloo: the work as torch made it (its wait blocks the CPU and fails when the abort
        # shuts its sockets). NCCL: a wait that blocks the CPU, bounded, with the abort in view.
        return SupervisedWork(self, work) if self.backend == "nccl" else work

    def _refuse_if_aborted(self) -> None:
        # An aborted ProcessGroupNCCL may lazily create a fresh communicator for a new
        # collective; a generation that was aborted must never talk again. (gloo's aborted
        # sockets fail by themselves, as before.)
        if self.backend == "nccl" and self._aborted.is_set():
            raise PeerFailure(f"generation {self.gen} was aborted")

    @property
    def store(self) -> dist.Store:
        return self._store

    # ---- sharded jobs (hotspare/sharded): the generation's torch group and its subgroups
    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """This generation's default torch group (None before ``connect``)."""
        return self._pg

    def subgroup(self, ranks: list[int]) -> dist.ProcessGroup:
        """A subgroup of this generation (``dist.new_group``: every member of the generation calls
        it, for every subgroup, in the same order), whose sockets this generation's ``abort`` shuts
        down with its own."""
        self._refuse_if_aborted()
        with self._recording():
            return dist.new_group(ranks, timeout=self.timeout)

    def adopt(self, sock: socket.socket) -> None:
        """Make ``sock`` (a connection hotspare opened for this generation: a buddy link) part of
        the generation: its ``abort`` shuts it down with the backend's own connections."""
        fd = sock.fileno()
        link = os.readlink(f"/proc/self/fd/{fd}")
        with self._lock:
            aborted = self._aborted.is_set()
            if not aborted:
                self._adopted[fd] = link
        if aborted:
            _shutdown_connected({fd: link})

    @contextmanager
    def _recording(self):
        before = _socket_fds()
        try:
            yield
        finally:
            after = _socket_fds()
            with self._lock:
                self._fds.update({fd: l for fd, l in after.items() if before.get(fd) != l})

    def abort(self) -> None:
        """Make every collective of this generation fail now, here and (by cascade) on peers.

        Safe to call from any thread, any number of times."""
        with self._lock:
            self._aborted.set()
            fds, pg = dict(self._fds), self._pg
            adopted, self._adopted = self._adopted, {}
        _shutdown_connected(adopted)
        if self.backend == "nccl":
            if pg is not None:
                self._abort_nccl(pg)
            return
        _shutdown_connected(fds)

    def _abort_nccl(self, pg: dist.ProcessGroup) -> None:
        # ncclCommAbort has been seen never to return on a communicator whose peer was stopped
        # mid-collective (blocking communicators); the caller (the control thread) must not hang
        # with it. So it runs in a thread of its own, and after abort_deadline_s the generation
        # reports abort_stuck: this process cannot free its GPU in-process and must be replaced.
        with self._lock:
            thread = self._abort_thread
            if thread is None:
                thread = self._abort_thread = threading.Thread(
                    target=pg.abort, name=f"hotspare-nccl-abort-gen{self.gen}", daemon=True)
                thread.start()
        thread.join(self.abort_deadline_s)

    @property
    def abort_stuck(self) -> bool:
        """True when an NCCL abort did not return within ``abort_deadline_s``: the worker
        should exit and be replaced (a fresh process from a spare) rather than rejoin."""
        t = self._abort_thread
        return t is not None and t.is_alive()

    def wait(self, work: dist.Work, timeout_s: float | None = None, poll_s: float = 0.0005) -> None:
        """Wait for ``work`` on the CPU, the way hotspare supervises a collective: returns when
        it completed; raises ``PeerFailure`` as soon as the generation is aborted, or, after
        ``timeout_s`` (default: the group's collective timeout), aborts the generation and
        raises. For NCCL, where ``work.wait()`` does not block the CPU, this is the wait that
        sees a hang; for gloo it is the same as ``work.wait()`` bounded by the abort."""
        limit = self.timeout.total_seconds() if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while not work.is_completed():
            if self._aborted.is_set():
                raise PeerFailure(f"generation {self.gen} aborted during a collective")
            if time.monotonic() > deadline:
                self.abort()
                raise PeerFailure(f"a collective of generation {self.gen} did not complete in "
                                  f"{limit:.1f} s: the generation is aborted")
            time.sleep(poll_s)
        try:
            work.wait()          # raises the backend's error of a failed work
        except Exception as e:   # noqa: BLE001 - an aborted or failed collective
            raise PeerFailure(f"a collective of generation {self.gen} failed: {e}") from e

    def destroy(self) -> None:
        self.abort()
        if not dist.is_initialized():
            return
        if self.backend == "nccl":
            if self.abort_stuck:
                return           # calling abort again would hang here too; the process is done
            # The communicator is aborted already; shutdown() would try a graceful
            # ncclCommDestroy of it. This drops the aborted group from torch's registry.
            from torch.distributed.distributed_c10d import _abort_process_group
            _abort_process_group()
        else:
            dist.destroy_process_group()


class SupervisedWork:
    """An NCCL work of a generation whose ``wait()`` is the generation's supervised wait
    (:meth:`GenerationGroup.wait`): it blocks the CPU until the collective completed, raises
    ``PeerFailure`` as soon as the generation is aborted, and aborts the generation itself when
    the collective has not completed within ``wait_timeout_s`` (default: the group's collective
    timeout). The callers (the gradient buckets, the per-rank rows) just call ``work.wait()``."""

    def __init__(self, group: GenerationGroup, work: dist.Work, wait_timeout_s: float | None = None):
        self.group, self.work, self.wait_timeout_s = group, work, wait_timeout_s

    def wait(self, timeout: "datetime.timedelta | float | None" = None) -> bool:
        """``timeout`` (a ``timedelta``, as torch's ``Work.wait`` takes, or seconds) replaces
        ``wait_timeout_s`` for this call."""
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds() or None     # torch's default timedelta(0): none given
        self.group.wait(self.work, self.wait_timeout_s if timeout is None else timeout)
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()
