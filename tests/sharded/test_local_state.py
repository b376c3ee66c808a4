"""The local view of DTensor state (hotspare/sharded/localize.py) and the proxy group
(hotspare/pg/proxy.py), in one process: a one-rank mesh, real FSDP2, real DTensors."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from hotspare.errors import PeerFailure
from hotspare.pg.proxy import ProxyGroup
from hotspare.runtime.state import StateRegistry


@pytest.fixture(scope="module")
def mesh():
    # a world of one in the test process, gone again after this module (later modules build
    # their own default group)
    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if ours:
        dist.destroy_process_group()


def _trained(mesh, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def test_a_fresh_optimizer_gets_dtensor_state_laid_out_like_its_parameters(mesh):
    model, opt = _trained(mesh, 0)
    src = StateRegistry()
    src.add("model", model)
    src.add("optimizer", opt)
    assert src.sharded == {"model", "optimizer"}
    snap = src.snapshot()
    assert not any(isinstance(t, DTensor) for _, t in snap.tensors)     # local shards, plain tensors
    other, fresh = _trained(mesh, 1)
    fresh.state.clear()                                                 # a spare's optimizer
    dst = StateRegistry()
    dst.add("model", other)
    dst.add("optimizer", fresh)
    manifest = snap.manifest(0)
    dsts, needs = dst.prepare_receive(manifest)
    for d, (_, t) in zip(dsts, snap.tensors):
        d.copy_(t)
    dst.finish_receive(manifest, dsts, needs)
    assert dst.digest() == src.digest()
    for p in fresh.param_groups[0]["params"]:
        assert isinstance(fresh.state[p]["exp_avg"], DTensor) and not isinstance(fresh.state[p]["step"], DTensor)


def test_the_proxy_refuses_without_a_generation_and_notes_the_failure():
    noted = []
    proxy = ProxyGroup(0, 1, "hotspare_test_proxy", lambda: None, on_error=noted.append)
    with pytest.raises(PeerFailure):
        proxy.allreduce([torch.ones(1)])
    assert len(noted) == 1 and proxy.group_name == "hotspare_test_proxy"


def test_the_proxy_forwards_to_the_current_group(mesh):
    current = {"pg": dist.distributed_c10d._get_default_group()}
    proxy = ProxyGroup(0, 1, "hotspare_test_proxy2", lambda: current["pg"])
    t = torch.tensor([3.0])
    proxy.allreduce([t]).wait()
    out = torch.empty(1)
    proxy.all_gather_single(out, t).wait()
    assert out.item() == 3.0
    current["pg"] = None
    with pytest.raises(PeerFailure):
        proxy.barrier()


def test_local_is_to_locals_shard_for_parameters_grads_and_optimizer_state(mesh):
    from hotspare.sharded.localize import local
    model, opt = _trained(mesh, 3)
    model(torch.randn(3, 4)).sum().backward()        # gradients as FSDP2 leaves them
    tensors = [t for p in model.parameters() for t in (p, p.grad)]
    tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, DTensor)]
    assert len(tensors) == 16 and all(isinstance(t, DTensor) for t in tensors)   # 4 x (p, grad, 2 moments)
    for t in tensors:
        a, b = local(t), t.to_local()
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
        assert a.dtype == b.dtype and torch.equal(a, b)
    plain = torch.ones(2)
    assert local(plain) is plain
