import pytest
import torch

from hotspare.errors import ConfigError, StateMismatch
from hotspare.runtime.state import StateRegistry
from hotspare.transfer import plan_buckets


def make(seed=0, steps=2):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    for _ in range(steps):
        m(torch.randn(3, 8)).sum().backward()
        opt.step()
    reg = StateRegistry()
    reg.add("model", m)
    reg.add("optimizer", opt)
    return m, opt, reg


def receive(src: StateRegistry, dst: StateRegistry):
    snap = src.snapshot()
    manifest = snap.manifest(step=5)
    import json
    manifest = json.loads(json.dumps(manifest))      # it travels as JSON
    dsts, needs = dst.prepare_receive(manifest)
    for d, (_, t) in zip(dsts, snap.tensors):
        d.copy_(t)                                    # what the broadcast does
    dst.finish_receive(manifest, dsts, needs)
    return needs


def test_fresh_optimizer_receives_state_and_model_is_written_in_place():
    _, _, src = make(seed=1)
    m, opt, dst = make(seed=2, steps=0)
    weight = m[0].weight
    assert src.digest() != dst.digest()
    needs = receive(src, dst)
    assert needs == {"optimizer"}                     # model received in place, no load
    assert m[0].weight is weight
    assert src.digest() == dst.digest()
    # a second receive into the now-shaped optimizer is in place too
    _, _, src2 = make(seed=3)
    assert receive(src2, dst) == set() and src2.digest() == dst.digest()


def test_mismatched_model_is_refused_clearly():
    _, _, src = make()
    other = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 4))
    reg = StateRegistry()
    reg.add("model", other)
    reg.add("optimizer", torch.optim.AdamW(other.parameters()))
    with pytest.raises(StateMismatch, match="all ranks must build the same model"):
        reg.prepare_receive(src.snapshot().manifest(0))


def test_untransferable_state_and_bad_track_calls_are_config_errors():
    reg = StateRegistry()
    with pytest.raises(ConfigError, match="no state_dict"):
        reg.add("thing", object())

    class Weird:
        def state_dict(self):
            return {"fn": lambda: 0}

        def load_state_dict(self, sd):
            pass
    reg.add("weird", Weird())
    with pytest.raises(ConfigError, match="JSON-like values"):
        reg.snapshot()


def test_bucket_plan_groups_by_dtype_and_isolates_big_tensors():
    f, i = torch.float32, torch.int64
    plan = plan_buckets([(f, 10), (i, 1), (f, 10), (f, 1000), (f, 5)], bucket_bytes=400)
    assert plan == [[0, 2, 4], [1], [3]]
    assert plan_buckets([(f, 60), (f, 60)], bucket_bytes=400) == [[0], [1]]
