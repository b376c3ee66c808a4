"""State transfer between real processes over gloo: buckets, big tensors, mixed dtypes."""
import datetime
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hotspare.transfer import broadcast_state


def tensors(rank, many=False):
    g = torch.Generator().manual_seed(0 if rank == 0 else 100 + rank)
    if many:     # more small buckets than may be staged at once: the staging ring is reused
        return [torch.randn(300, generator=g) for _ in range(40)]
    return [torch.randn(1000, generator=g), torch.randint(0, 9, (7,), generator=g),
            torch.randn(300_000, generator=g), torch.tensor(3.0 + rank), torch.randn(5, 5, generator=g)]


def worker(rank, world, port, q):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    ts = tensors(rank)
    stats = broadcast_state(ts, src=0, group=None, is_source=rank == 0, bucket_bytes=64 * 1024)
    many = tensors(rank, many=True)
    more = broadcast_state(many, src=0, group=None, is_source=rank == 0, bucket_bytes=2048)
    assert more.buckets == 40 and all(torch.equal(a, b) for a, b in zip(many, tensors(0, many=True)))
    expect = tensors(0)
    q.put((rank, all(torch.equal(a, b) for a, b in zip(ts, expect)), stats.bytes, stats.buckets))
    dist.barrier()
    os._exit(0)


def test_broadcast_state_moves_every_tensor_bit_exact():
    # The store lives here, on a port the kernel picked: no window for another process to take it.
    store = dist.TCPStore("127.0.0.1", 0, 3, True, wait_for_workers=False)
    port = store.port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 3, port, q)) for r in range(3)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    nbytes = sum(t.numel() * t.element_size() for t in tensors(0))
    assert [r[1] for r in results] == [True, True, True]
    assert all(r[2] == nbytes for r in results)
    assert results[0][3] == 3      # floats packed, int64 packed, the 1.2 MB tensor alone
