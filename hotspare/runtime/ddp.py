"""DDP whose gradient reduction survives a change of generation, with a stable bucket layout.

Two facts shape this module:
* Bitwise equality needs every rank to reduce the same bytes in the same layout on every step.
  DDP normally rebuilds its buckets after the first iteration (in the order gradients became
  ready), so a freshly wrapped DDP on a spare would reduce in a different layout than the
  survivors. We rebuild the buckets once, right away, in parameter order: the layout is then a
  pure function of the model, the same on a spare, a survivor and under plain torchrun.
* DDP must not own the communicator: under hotspare it gets a one-rank group with no threads
  (``pg.SoloGroup``; building it on a spare needs no peers) and the real reduction runs in a
  comm hook on the current generation's default group, torn down and rebuilt on every failover.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hotspare.pg import SoloGroup


def stabilize_buckets(ddp: DDP) -> None:
    ddp.reducer._push_all_rebuilt_params()
    ddp.reducer._rebuild_buckets()


def reset_after_failure(ddp: DDP) -> None:
    """A backward that failed half-way leaves the reducer mid-iteration; reset it and lay the
    buckets out again exactly as before (reset_state forgets the rebuilt layout)."""
    ddp.reducer._reset_state()
    stabilize_buckets(ddp)


_ENGINE = torch.autograd.Variable._execution_engine


class GradientExchange(Protocol):
    """The seam between a gradient-sync wrapper (this DDP hook; an FSDP integration would be
    another) and the step protocol (runtime/steps.py ``StepProtocol``)."""

    def reduce_bucket(self, index: int, buf: torch.Tensor) -> dist.Work | BaseException: ...

    def finish_reduction(self, started: list, buffers: list[torch.Tensor]) -> BaseException | None: ...

    def broadcast_buffers(self, buffers) -> None: ...

    def reduce_side(self, tensor: torch.Tensor) -> dist.Work: ...


class _Backward:
    """One DDP's hook state: the buckets of the backward in progress."""

    def __init__(self, seam: GradientExchange):
        self.seam = seam
        self.inflight: list[tuple[Any, torch.futures.Future, torch.Tensor]] = []


def _allreduce_hook(state, bucket):  # no annotations: DDP checks them against real classes
    buf = bucket.buffer()
    if bucket.index() == 0:
        # DDP hands over its buckets strictly in index order, so bucket 0 opens this backward's
        # reduction. Queue the completion now, whatever happens to the later buckets: it runs at
        # the end of backward, before DDP's finalization (queued after the last bucket's hook),
        # which waits for every bucket's future and would wait forever for one left unset.
        state.inflight = []
        _ENGINE.queue_callback(lambda: _complete(state))
    # Never raises: a failure comes back as the outcome (raising inside the hook leaves DDP's
    # reducer half-way through a bucket), the future fails, and backward() reports it.
    outcome = state.seam.reduce_bucket(bucket.index(), buf)
    fut: torch.futures.Future = torch.futures.Future()
    state.inflight.append((outcome, fut, buf))
    return fut


def _complete(state: _Backward) -> None:
    """At the end of backward, on the training thread, before DDP reads the bucket futures: the
    step protocol waits for each bucket's all-reduce (and judges the step's health vote); DDP
    gets the result. No Python runs on gloo's threads (a callback there takes the GIL from the
    training thread on every bucket: +0.25 ms of CPU per step on each of gloo's two threads,
    measured on the 1M example)."""
    inflight, state.inflight = state.inflight, []
    error = state.seam.finish_reduction([o for o, _, _ in inflight], [b for _, _, b in inflight])
    for _, fut, buf in inflight:
        if error is None:
            fut.set_result(buf)
        else:
            fut.set_exception(error)


def _broadcast_buffers_hook(seam: GradientExchange):
    """DDP's buffer broadcast from rank 0, on the generation's group, exactly where plain DDP
    does it: at the start of ``DDP.forward`` (not the inner module's: an evaluation on
    ``model.module``, on rank 0 alone, issues no collective), and only when the previous forward
    was one whose gradients are synchronised (not under ``no_sync`` or ``torch.no_grad``)."""
    def hook(ddp: DDP, _inputs: Any) -> None:
        if ddp.require_forward_param_sync:
            seam.broadcast_buffers(ddp.module.buffers())
    return hook


def wrap_ddp(module: torch.nn.Module, seam: GradientExchange | None, **kwargs: Any) -> DDP:
    """DDP over ``module``: plain DDP when ``seam`` is None (not managed), else DDP whose
    reduction runs through the step protocol's gradient-exchange seam."""
    if "process_group" in kwargs:
        raise ValueError("hotspare manages the process group of job.ddp(); drop process_group=")
    if seam is None:
        ddp = DDP(module, **kwargs)
        stabilize_buckets(ddp)
        return ddp
    sync_buffers = kwargs.pop("forward_sync_buffers", kwargs.pop("broadcast_buffers", None))
    # DDP's own group is a world of one with no threads (pg/solo.py); the initial sync across
    # ranks is hotspare's (the first generation's state sync), so DDP's init_sync has no peers.
    kwargs.pop("init_sync", None)
    side = seam.reduce_side if kwargs.get("find_unused_parameters") else None
    ddp = DDP(module, process_group=SoloGroup(side), init_sync=False, forward_sync_buffers=False, **kwargs)
    stabilize_buckets(ddp)
    ddp.register_comm_hook(_Backward(seam), _allreduce_hook)
    if sync_buffers is not False and any(True for _ in module.buffers()):
        # DDP's own buffer broadcast would run on its one-rank group; do it on the generation's.
        ddp.register_forward_pre_hook(_broadcast_buffers_hook(seam))
    return ddp


__all__ = ["GradientExchange", "wrap_ddp", "reset_after_failure", "stabilize_buckets"]
