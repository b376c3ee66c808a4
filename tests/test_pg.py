"""DDP's own group of one (pg.SoloGroup): answers every collective at once, starts no thread,
and carries hotspare's DDP through building, rebuilding its buckets and training."""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hotspare.pg import SoloGroup
from hotspare.runtime.ddp import reset_after_failure, stabilize_buckets


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


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
    assert threads() == before, "a world of one needs no transport thread"
    assert not dist.is_initialized()
