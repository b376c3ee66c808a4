"""Virtual ranks (runtime/virtual.py): an elastic job's N data-parallel ranks on any number of
processes, moved between them at step boundaries, compute the same bits; every sample is trained
exactly once. Real processes over gloo, plain torch.distributed (no coordinator)."""
import datetime
import hashlib
import os
import queue

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VWORLD, STEPS, SAMPLES, BATCH = 4, 10, 64, 4      # 4 batches per virtual rank per epoch: 2.5 epochs


def make_loader(v, n):
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    g = torch.Generator().manual_seed(1234)
    ds = TensorDataset(torch.arange(SAMPLES), torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g))
    return DataLoader(ds, batch_size=BATCH, sampler=DistributedSampler(ds, num_replicas=n, rank=v, shuffle=True, seed=7))


def worker(n, rank, world, port, plan, q):
    torch.set_num_threads(1)
    from hotspare.runtime.virtual import VirtualRanks
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                              torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    vr = VirtualRanks(net, vworld=VWORLD, placement=plan[0], rank=rank, make_loader=make_loader, seed=100,
                      broadcast_buffers=False, bucket_cap_mb=0.0003)     # several buckets
    model = vr.model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    seen = []
    for step in range(STEPS):
        if step in plan:
            vr.place(plan[step])
        for v, (idx, x, y) in vr.shares():
            torch.nn.functional.mse_loss(model(x), y).backward()
            seen.append((step, v, idx.tolist()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    h = hashlib.sha256()
    for t in list(net.parameters()) + [s for st in opt.state.values() for s in st.values()]:
        h.update(t.detach().numpy().tobytes())
    rows = {v: hashlib.sha256(vr.slots[v].numpy().tobytes()).hexdigest() for v in vr.held}
    q.put((n, rank, h.hexdigest(), rows, seen))
    q.close()
    q.join_thread()           # the result is in the pipe before the process ends (os._exit skips the flush)
    dist.barrier()
    os._exit(0)


def run(*plans):
    """Each plan's processes, all at once; per plan (digest, per-virtual-rank rows, samples seen)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs, stores = {}, []
    for n, plan in enumerate(plans):
        world = max(max(p.values()) for p in plan.values()) + 1
        stores.append(dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False))
        for r in range(world):
            procs[n, r] = ctx.Process(target=worker, args=(n, r, world, stores[-1].port, plan, q))
            procs[n, r].start()
    out = []
    while len(out) < len(procs):
        try:
            out.append(q.get(timeout=1))
        except queue.Empty:
            dead = [k for k, p in procs.items() if p.exitcode not in (None, 0)]
            assert not dead, f"worker(s) {dead} crashed"
            assert any(p.exitcode is None for p in procs.values()), "every worker ended, some without a result"
    for p in procs.values():
        p.join(30)
    results = []
    for n in range(len(plans)):
        mine = [o for o in out if o[0] == n]
        digests = {d for _, _, d, _, _ in mine}
        assert len(digests) == 1, "the processes of one run disagree on the replicated state"
        rows = {v: r for *_, rs, _ in mine for v, r in rs.items()}
        seen = sorted(s for *_, ss in mine for s in ss)
        results.append((digests.pop(), rows, seen))
    return results


def each(vworld, procs):
    return {v: v * procs // vworld for v in range(vworld)}


def assert_every_sample_once_per_epoch(seen):
    per_epoch = SAMPLES // (VWORLD * BATCH)
    by_epoch = {}
    for step, v, idx in seen:
        by_epoch.setdefault(step // per_epoch, []).extend(idx)
    for epoch, idx in by_epoch.items():
        assert len(idx) == len(set(idx)), f"a sample trained twice in epoch {epoch}"
        if (epoch + 1) * per_epoch <= STEPS:
            assert sorted(idx) == list(range(SAMPLES))


@pytest.mark.slow
def test_shrunk_and_regrown_placements_train_the_same_bits_as_one_process_per_virtual_rank():
    # two processes: virtual rank 1's share moves to process 0 at step 4 (a shrink: process 0
    # runs three), then back at step 7 (a regrow), mid-epoch and across an epoch's end
    moving = {0: {0: 0, 1: 1, 2: 1, 3: 1}, 4: {0: 0, 1: 0, 2: 0, 3: 1}, 7: {0: 0, 1: 1, 2: 0, 3: 1}}
    one, moved = run({0: each(VWORLD, 1)}, moving)
    assert moved[0] == one[0], "replicated state differs"
    assert moved[1] == one[1], "a virtual rank's per-rank state (generator, buffers, data position) differs"
    assert moved[2] == one[2], "a step trained different samples"
    assert_every_sample_once_per_epoch(one[2])


@pytest.mark.slow
def test_four_and_three_processes_agree_with_one():
    one, four, three = run({0: each(VWORLD, 1)}, {0: each(VWORLD, 4)},
                           {0: {0: 0, 1: 1, 2: 2, 3: 0}, 5: {0: 0, 1: 1, 2: 2, 3: 2}})
    assert four == one and three == one


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_gradient_is_every_virtual_ranks_own_summed_in_virtual_rank_order(world_of_one):
    from hotspare.runtime.virtual import VirtualRanks
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    ref = [p.detach().clone() for p in net.parameters()]
    vr = VirtualRanks(net, vworld=VWORLD, placement=each(VWORLD, 1), rank=0, make_loader=make_loader, seed=100)
    model = vr.model
    for v, (_, x, y) in vr.shares():
        torch.nn.functional.mse_loss(model(x), y).backward()
    # the oracle: each virtual rank alone, its generator seeded seed + v, its shard's first batch
    expect = None
    for v in range(VWORLD):
        alone = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
        with torch.no_grad():
            for p, r in zip(alone.parameters(), ref):
                p.copy_(r)
        torch.manual_seed(100 + v)
        _, x, y = next(iter(make_loader(v, VWORLD)))
        torch.nn.functional.mse_loss(alone(x), y).backward()
        g = [p.grad.div(VWORLD) for p in alone.parameters()]
        expect = g if expect is None else [e.add_(a) for e, a in zip(expect, g)]
    assert all(torch.equal(p.grad, e) for p, e in zip(net.parameters(), expect))


def test_what_an_elastic_ddp_cannot_do_is_refused(world_of_one):
    from hotspare.runtime.virtual import VirtualRanks
    bn = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="broadcast_buffers=False"):
        VirtualRanks(bn, vworld=2, placement={0: 0, 1: 0}, rank=0, make_loader=make_loader)
    with pytest.raises(ValueError, match="find_unused_parameters"):
        VirtualRanks(torch.nn.Linear(8, 1), vworld=2, placement={0: 0, 1: 0}, rank=0, make_loader=make_loader,
                     find_unused_parameters=True)


def test_an_enabled_grad_scaler_is_refused_at_the_first_share(world_of_one, monkeypatch):
    import sys

    from hotspare.errors import ConfigError
    from hotspare.runtime.job import Job
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)     # Job puts its own in; put back after
    job = Job()
    job._start()
    vr = job.virtual_ranks(torch.nn.Linear(8, 1), make_loader, seed=1)
    opt = torch.optim.SGD(vr.model.parameters(), lr=0.1)
    job.track(model=vr.model, optimizer=opt, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ConfigError, match="GradScaler"):
        next(iter(vr.shares()))
