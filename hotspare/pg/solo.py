"""A process group of one rank, with no threads and no sockets, for DDP's own bookkeeping.

hotspare's DDP reduces gradients in a comm hook on the *current* generation's group; DDP itself
gets a group of one, so that building it on a spare needs no peers and no collective of DDP's
outlives a generation. What DDP still asks of that group is a world of one: its rank and size,
and a broadcast of its bucket layout when the buckets are rebuilt (``_rebuild_buckets``); with
``find_unused_parameters=True`` also the all-reduce of which parameters each rank used, which
must span the real ranks (``side``).

A one-rank gloo group would do that too, but gloo's transport thread wakes up every 10 ms for
the life of the process: ~100 wake-ups and ~2 ms of CPU a second in every worker and spare,
about 0.5 % of a 4-rank job on two cores, for a group that never sends a byte. Here every
collective of a world of one is answered at once in the calling thread: the data is already
where it has to be (allgather copies input to output).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future


def _done(value) -> dist.Work:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return _create_work_from_future(fut)


class SoloGroup(dist.ProcessGroup):
    """World size 1, rank 0; every collective completes immediately and in place."""

    def __init__(self, side: "Callable[[torch.Tensor], dist.Work] | None" = None) -> None:
        super().__init__(0, 1)
        # DDP with find_unused_parameters=True all-reduces the map of the parameters each rank
        # used in a backward on its own group; ``side`` runs it on the generation's group instead
        # (every rank issues it at the same point: after the backward's last bucket).
        self._side = side

    def getBackendName(self) -> str:
        return "hotspare-solo"

    def broadcast(self, tensors, opts=None):
        return _done(tensors)

    def allreduce(self, tensors, opts=None):
        if self._side is not None:
            work = self._side(tensors[0])
            if not isinstance(work, dist.Work):     # a supervised NCCL work: wait here
                work.wait()
                return _done(tensors)
            return work
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return _done(tensors)

    def allgather(self, output_lists, inputs, opts=None):
        for outs, inp in zip(output_lists, inputs):
            outs[0].copy_(inp)
        return _done(output_lists)

    def _allgather_base(self, output, input, opts=None):
        output.copy_(input.reshape(output.shape))
        return _done([output])

    def barrier(self, opts=None):
        return _done([])


__all__ = ["SoloGroup"]
