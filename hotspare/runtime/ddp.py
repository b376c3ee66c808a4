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

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hotspare.errors import PeerFailure, StateTrackingError
from hotspare.pg import SoloGroup
from hotspare.runtime.vote import HealthFault

if TYPE_CHECKING:
    from hotspare.runtime.job import Job


def stabilize_buckets(ddp: DDP) -> None:
    ddp.reducer._push_all_rebuilt_params()
    ddp.reducer._rebuild_buckets()


def reset_after_failure(ddp: DDP) -> None:
    """A backward that failed half-way leaves the reducer mid-iteration; reset it and lay the
    buckets out again exactly as before (reset_state forgets the rebuilt layout)."""
    ddp.reducer._reset_state()
    stabilize_buckets(ddp)


_ENGINE = torch.autograd.Variable._execution_engine


def _allreduce_hook(job, bucket):  # no annotations: DDP checks them against real classes
    buf = bucket.buffer()
    job._entering_reduction()
    if bucket.index() == 0:
        # DDP hands over its buckets strictly in index order, so bucket 0 opens this backward's
        # reduction. Queue the completion now, whatever happens to the later buckets: it runs at
        # the end of backward, before DDP's finalization (queued after the last bucket's hook),
        # which waits for every bucket's future and would wait forever for one left unset.
        job._inflight = []
        _ENGINE.queue_callback(lambda: _complete(job))
    outcome: dist.Work | BaseException
    if job._generation_broken():
        outcome = PeerFailure(f"generation {job.generation} was aborted")
    else:
        try:
            if bucket.index() == 0:
                job.begin_gather()       # every rank's per-rank state, gathered beside the buckets
            # Scale by 1/world (DDP's own arithmetic, so the result is bitwise equal to plain
            # DDP's with the same layout) and note this rank's own NaN/Inf, in one pass.
            job._scale_and_inspect(buf)
            outcome = job._group.allreduce(buf)
        except Exception as e:
            # Never raise inside the hook: that leaves DDP's reducer half-way through a bucket.
            # The future fails instead, and backward() reports it like any communication error.
            job._note_comm_error(e)
            outcome = e
    fut: torch.futures.Future = torch.futures.Future()
    job._inflight.append((outcome, fut, buf))
    return fut


def _complete(job: "Job") -> None:
    """At the end of backward, on the training thread, before DDP reads the bucket futures: wait
    for each bucket's all-reduce and hand DDP its result. No Python runs on gloo's threads (a
    callback there takes the GIL from the training thread on every bucket: +0.25 ms of CPU per
    step on each of gloo's two threads, measured on the 1M example). The health vote, launched
    as the step began, is judged here: a verdict against this step fails the buckets on every
    rank alike, before any optimizer steps."""
    inflight, job._inflight = job._inflight, []
    vote = job._take_vote()
    error: BaseException | None = None
    for outcome, _, _ in inflight:
        if isinstance(outcome, BaseException):
            error = outcome
            break
        try:
            outcome.wait()
        except Exception as e:          # the first failure is the step's; DDP stops there too
            job._note_comm_error(e)
            error = e
            break
    if error is None:
        try:
            job.finish_gather()
        except Exception as e:
            error = e
    if error is None and vote is not None:
        try:
            job._judge(vote.wait()[0])  # raises HealthFault when the vote goes against this step
        except (HealthFault, StateTrackingError) as e:
            error = e
        except Exception as e:
            job._note_comm_error(e)
            error = e
    for _, fut, buf in inflight:
        if error is None:
            fut.set_result(buf)
        else:
            fut.set_exception(error)
    job._buckets = [] if error is not None else [buf for _, _, buf in inflight]


def _broadcast_buffers_hook(job: "Job"):
    """DDP's buffer broadcast from rank 0, on the generation's group, exactly where plain DDP
    does it: at the start of ``DDP.forward`` (not the inner module's: an evaluation on
    ``model.module``, on rank 0 alone, issues no collective), and only when the previous forward
    was one whose gradients are synchronised (not under ``no_sync`` or ``torch.no_grad``)."""
    def hook(ddp: DDP, _inputs: Any) -> None:
        if not ddp.require_forward_param_sync:
            return
        job._check_generation()
        for b in ddp.module.buffers():
            dist.broadcast(b, src=0)
    return hook


def wrap_ddp(module: torch.nn.Module, job: "Job", **kwargs: Any) -> DDP:
    if "process_group" in kwargs:
        raise ValueError("hotspare manages the process group of job.ddp(); drop process_group=")
    if not job.managed:
        ddp = DDP(module, **kwargs)
        stabilize_buckets(ddp)
        return ddp
    sync_buffers = kwargs.pop("forward_sync_buffers", kwargs.pop("broadcast_buffers", None))
    # DDP's own group is a world of one with no threads (pg/solo.py); the initial sync across
    # ranks is hotspare's (the first generation's state sync), so DDP's init_sync has no peers.
    kwargs.pop("init_sync", None)
    ddp = DDP(module, process_group=SoloGroup(), init_sync=False, forward_sync_buffers=False, **kwargs)
    stabilize_buckets(ddp)
    ddp.register_comm_hook(job, _allreduce_hook)
    if sync_buffers is not False and any(True for _ in module.buffers()):
        # DDP's own buffer broadcast would run on its one-rank group; do it on the generation's.
        ddp.register_forward_pre_hook(_broadcast_buffers_hook(job))
    return ddp


__all__ = ["wrap_ddp", "reset_after_failure", "stabilize_buckets"]
