"""broadcast_state across devices (transfer/broadcast.py): the wire is where the backend moves
bytes; CUDA tensors over gloo go through pinned host staging, CPU tensors over NCCL through the
device. The CUDA runs need a GPU (also run by bench/gpu_check.py)."""
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hotspare.pg import GenerationGroup
from hotspare.transfer import broadcast_state, checksum, digest_of, wire_device

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="needs a CUDA GPU: run bench/gpu_check.py on a GPU machine")


def test_the_wire_of_a_gloo_generation_is_the_host():
    g = GenerationGroup(dist.HashStore(), gen=1, rank=0, world=1, prefix="w/")
    g.connect()
    try:
        assert wire_device(None) == torch.device("cpu")
        ts = [torch.randn(100_000), torch.randn(10), torch.arange(5)]
        stats = broadcast_state(ts, src=0, group=None, is_source=True)
        assert stats.buckets == 3 and stats.bytes == 400_000 + 40 + 40
    finally:
        g.destroy()


def test_the_checksum_does_not_depend_on_alignment_or_on_which_side_computes_it():
    t = torch.randn(1001)
    words = t.view(torch.uint8)
    assert checksum(t[1:]) == checksum(t[1:].clone())          # mid-word start: numpy path
    assert checksum(words[3:]) == checksum(words[3:].clone())
    assert checksum(t) != checksum(t.clone().index_fill_(0, torch.tensor([500]), 0.0))


def peer(rank, port, where, q):
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    g = torch.Generator().manual_seed(1)
    src = [torch.randn(300_000, generator=g), torch.randn(500, generator=g),
           torch.randint(0, 9, (77,), generator=g), torch.randn(64, 64, generator=g).to(torch.bfloat16)]
    ts = [t.to("cuda") if rank == 0 else torch.zeros_like(t, device=where) for t in src]
    broadcast_state(ts, src=0, group=None, is_source=rank == 0, bucket_bytes=64 * 1024)
    q.put((rank, digest_of(ts) == digest_of(src)))
    dist.barrier()
    os._exit(0)


@needs_gpu
@pytest.mark.parametrize("receiver", ["cuda", "cpu"])
def test_cuda_state_over_gloo_goes_through_pinned_host_memory_bit_exact(receiver):
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=peer, args=(r, store.port, receiver, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert results == [(0, True), (1, True)]


@needs_gpu
def test_cuda_and_cpu_state_over_a_world_of_one_nccl_group():
    g = GenerationGroup(dist.HashStore(), 1, 0, 1, "n/", backend="nccl", device="cuda:0")
    g.connect()
    try:
        assert wire_device(None) == torch.device("cuda", 0)
        t = torch.randn(1 << 16, device="cuda")
        assert checksum(t) == checksum(t.cpu()) and checksum(t[1:]) == checksum(t[1:].cpu())
        ts = [t, torch.randn(10, device="cuda"), torch.arange(5)]
        assert broadcast_state(ts, src=0, group=None, is_source=True).buckets == 3
    finally:
        g.destroy()
