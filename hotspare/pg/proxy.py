"""A process group that stays while generations come and go: the group a DeviceMesh is built on.

FSDP2 and DTensor keep the process groups of their ``DeviceMesh`` for the life of the module
(every ``FSDPParamGroup`` holds its mesh's groups; every DTensor's spec holds the mesh; DTensor's
functional collectives find the group by name in torch's C++ registry). hotspare builds a new
group per generation (``pg/generation.py``), so the mesh cannot hold a generation's group.
It holds a ``ProxyGroup`` instead: a ``dist.ProcessGroup`` subclass with this rank's fixed rank
and the dimension's fixed size (a spare takes the lost rank's id, so both never change), whose
every collective is forwarded to the current generation's real group, looked up at call time
(``resolve``). Checked on torch 2.13: ``fully_shard`` over a mesh of proxies, with
``MixedPrecisionPolicy``, accumulation and ``clip_grad_norm_`` over DTensors, trains bitwise
equal to the same script over ``init_device_mesh`` (tests/sharded/test_proxy.py).

Why a proxy and not a rebuild of FSDP's groups per generation: the groups sit in private
fields of several torch objects (param groups, meshes, the DTensor specs of every parameter and
optimizer state), which a rebuild would have to find and patch in every torch release; the
proxy uses only what torch calls on a group: ``dist.all_gather_single`` /
``reduce_scatter_single`` call the group's Python methods, and the C++ functional collectives
call its virtual ``allreduce`` etc. through the ``ProcessGroup`` trampoline (as DDP calls
``pg/solo.py``'s).

A collective issued while no generation is formed (or the one it resolves to was aborted)
raises ``PeerFailure`` at once: the step fails like any collective of a broken generation.
"""
from __future__ import annotations

from typing import Callable

import torch.distributed as dist
from torch._C._distributed_c10d import _register_process_group, _resolve_process_group, _unregister_process_group

from hotspare.errors import PeerFailure


class _NotedWork(dist.Work):
    """The real group's work; a failed ``wait`` is reported to ``on_error`` first. (torch's
    collective wrappers then replace the error by a ValueError of their own logging, which
    cannot find a Python group in its tables: the note is what tells the step a peer failed.)"""

    def __init__(self, work: dist.Work, on_error: Callable[[BaseException], None]) -> None:
        super().__init__()
        self._work, self._on_error = work, on_error

    def wait(self, timeout=None):
        try:
            return self._work.wait() if timeout is None else self._work.wait(timeout)
        except Exception as e:
            self._on_error(e)
            raise

    def is_completed(self):
        return self._work.is_completed()

    def is_success(self):
        return self._work.is_success()

    def exception(self):
        return self._work.exception()

    def get_future(self):
        return self._work.get_future()

    def result(self):
        return self._work.result()


class ProxyGroup(dist.ProcessGroup):
    """Rank ``rank`` of ``size``; collectives go to ``resolve()``'s group (raise when none)."""

    def __init__(self, rank: int, size: int, name: str, resolve: Callable[[], dist.ProcessGroup],
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        super().__init__(rank, size)
        self._name = name
        self._resolve = resolve
        self._on_error = on_error
        self.register()

    def register(self) -> None:
        """Put this group in torch's C++ registry under its name, where DTensor's functional
        collectives look it up. ``destroy_process_group`` (a generation's teardown) empties
        that registry: call again once the next generation is formed."""
        try:
            if _resolve_process_group(self._name) is self:
                return
            _unregister_process_group(self._name)
        except RuntimeError:
            pass            # not registered
        _register_process_group(self._name, self)

    # torch reads the name from a backend, and a Python group has none: answer it here.
    @property
    def group_name(self) -> str:
        return self._name

    def getBackendName(self) -> str:
        return "hotspare-proxy"

    def _target(self) -> dist.ProcessGroup:
        try:
            pg = self._resolve()
        except BaseException as e:
            if self._on_error is not None:
                self._on_error(e)
            raise
        if pg is None:
            e = PeerFailure("no generation is formed: a sharded collective cannot run")
            if self._on_error is not None:
                self._on_error(e)
            raise e
        if pg.size() != self.size() or pg.rank() != self.rank():
            raise AssertionError(f"generation group is rank {pg.rank()}/{pg.size()}, "
                                 f"the mesh's proxy {self.rank()}/{self.size()}")
        return pg

    def _call(self, fn: Callable[[dist.ProcessGroup], dist.Work]) -> dist.Work:
        pg = self._target()
        try:
            work = fn(pg)
        except Exception as e:
            if self._on_error is not None:
                self._on_error(e)
            raise
        return work if self._on_error is None or work is None else _NotedWork(work, self._on_error)

    # ------------------------------------------------------------------ what FSDP2 and DTensor call
    def all_gather_single(self, output, input, opts=None):
        return self._call(lambda pg: pg._allgather_base(output, input))

    def _allgather_base(self, output, input, opts=None):
        return self._call(lambda pg: pg._allgather_base(output, input))

    def reduce_scatter_single(self, output, input, opts=None):
        o = dist.ReduceScatterOptions()
        if opts is not None:
            o.reduceOp = opts.reduceOp
        return self._call(lambda pg: pg._reduce_scatter_base(output, input, o))

    def _reduce_scatter_base(self, output, input, opts=None):
        return self.reduce_scatter_single(output, input, opts)

    def allreduce(self, tensors, opts=None):
        o = opts if opts is not None else dist.AllreduceOptions()
        return self._call(lambda pg: pg.allreduce(tensors, o))

    def broadcast(self, tensors, opts=None):
        o = opts if opts is not None else dist.BroadcastOptions()
        return self._call(lambda pg: pg.broadcast(tensors, o))

    def allgather(self, output_lists, inputs, opts=None):
        return self._call(lambda pg: pg.allgather(output_lists, inputs))

    def barrier(self, opts=None):
        return self._call(lambda pg: pg.barrier())


__all__ = ["ProxyGroup"]
