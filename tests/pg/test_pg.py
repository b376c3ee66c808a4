"""DDP's own group of one (pg.SoloGroup): answers every collective at once, starts no thread,
and carries hotspare's DDP through building, rebuilding its buckets and training; hotspare's
comm hook on a real generation group completes every bucket, also when the group breaks."""
import os
import threading

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hotspare.errors import PeerFailure
from hotspare.pg import GenerationGroup, SoloGroup
from hotspare.runtime.ddp import _allreduce_hook, _Backward, reset_after_failure, stabilize_buckets


def threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def test_every_collective_of_a_world_of_one_completes_in_place():
    pg = SoloGroup()
    assert (pg.rank(), pg.size()) == (0, 1)
    t = torch.arange(4.0)
    assert pg.broadcast([t]).wait() and torch.equal(t, torch.arange(4.0))
    assert pg.allreduce([t]).wait() and torch.equal(t, torch.arange(4.0))
    out = [[torch.zeros(4)]]
    pg.allgather(out, [t]).wait()
    assert torch.equal(out[0][0], t)
    flat = torch.zeros(4)
    pg._allgather_base(flat, t).wait()
    assert torch.equal(flat, t)
    assert pg.barrier().wait()


def test_ddp_on_it_trains_like_a_plain_module_and_starts_no_thread():
    before = threads()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    twin.load_state_dict(model.state_dict())
    ddp = DDP(model, process_group=SoloGroup(), init_sync=False, forward_sync_buffers=False)
    stabilize_buckets(ddp)                       # a rebuild: a broadcast of the bucket layout

    def hook(_state, bucket):                    # what hotspare's hook leaves out: the peers
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, twin)]
    x = torch.randn(5, 8)
    for step in range(3):
        if step == 1:
            reset_after_failure(ddp)             # a failed step's reset rebuilds the buckets again
        for m, opt in zip((ddp, twin), opts):
            opt.zero_grad()
            m(x).square().sum().backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    assert not threads() - before, "a world of one needs no transport thread"   # (an earlier test's may end)
    assert not dist.is_initialized()


class _Seam:
    """A gradient-exchange seam (runtime/ddp.py ``GradientExchange``) around a real generation
    group of one: after ``abort_after`` buckets it aborts the group, as the control thread does
    when a peer dies; then it reports the broken generation, as the step protocol does."""

    def __init__(self, group, abort_after=None):
        self.group, self.abort_after = group, abort_after
        self.reduced, self.scaled = None, 0

    def reduce_bucket(self, index, buf):
        if self.group.aborted:
            return PeerFailure("generation 1 was aborted")
        self.scaled += 1
        if self.scaled == self.abort_after:
            self.group.abort()
        return self.group.allreduce(buf)

    def finish_reduction(self, started, buffers):
        for work in started:
            if isinstance(work, BaseException):
                return work
            try:
                work.wait()
            except Exception as e:
                return e
        self.reduced = list(buffers)
        return None


def _bucketed_ddp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
    ddp = DDP(model, process_group=SoloGroup(), init_sync=False, forward_sync_buffers=False,
              bucket_cap_mb=0.1)
    stabilize_buckets(ddp)
    return ddp


def _backward_in_thread(ddp, timeout=30.0):
    outcome = {}

    def run():
        try:
            ddp(torch.randn(3, 128)).square().sum().backward()
            outcome["ok"] = True
        except Exception as e:
            outcome["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "backward hung: a bucket's future was never completed"
    return outcome


@pytest.mark.parametrize("abort_after", [None, 1, 2])
def test_hotspare_hook_completes_every_bucket_even_when_the_generation_breaks_midway(abort_after):
    # The group is aborted after the first (or second) bucket went out: the later buckets'
    # hooks see a broken generation. Every bucket's future must still be completed, or DDP's
    # finalization waits forever for the first one; backward raises the failure instead.
    group = GenerationGroup(dist.HashStore(), gen=1, rank=0, world=1, prefix="g1/")
    group.connect()
    try:
        ddp = _bucketed_ddp()
        seam = _Seam(group, abort_after)
        state = _Backward(seam)
        ddp.register_comm_hook(state, _allreduce_hook)
        outcome = _backward_in_thread(ddp)
        if abort_after is None:
            assert outcome == {"ok": True} and seam.scaled >= 3, "the test needs several buckets"
            assert len(seam.reduced) == seam.scaled and not state.inflight
        else:
            assert "was aborted" in str(outcome.get("error")), outcome
            assert seam.reduced is None and seam.scaled == abort_after and not state.inflight
    finally:
        group.destroy()
