"""Device snapshots (transfer/snapshot.py): host copies in reused buffers, restored bit for bit.
On CPU the copies are plain; the asynchronous CUDA path (side stream, pinned buffers, events)
is checked by the skipped tests below and bench/gpu_check.py on a GPU."""
import pytest
import torch

from hotspare.transfer import DeviceSnapshot, digest_of

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="needs a CUDA GPU: run bench/gpu_check.py on a GPU machine")


def state(device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(1000, generator=g), torch.randint(0, 9, (7, 3), generator=g),
          torch.randn(64, 64, generator=g).to(torch.bfloat16), torch.tensor(3.0), torch.zeros(0)]
    return [t.to(device) for t in ts]


def test_snapshot_then_restore_gives_back_the_same_bits_and_reuses_its_buffers():
    ts = state()
    want = digest_of(ts)
    snap = DeviceSnapshot()
    snap.start(ts)
    assert snap.ready and snap.wait().allocations == len(ts)
    assert snap.digest() == want and snap.stats.bytes == sum(t.numel() * t.element_size() for t in ts)
    host_ptrs = [b.data_ptr() for b in snap.host]
    for t in ts:                       # training goes on: the state changes after the snapshot
        t.add_(1) if t.is_floating_point() else t.mul_(2)
    assert digest_of(ts) != want and snap.digest() == want
    snap.restore(ts)
    assert digest_of(ts) == want
    snap.start(ts)                     # the next snapshot reuses every buffer
    assert snap.wait().allocations == 0 and [b.data_ptr() for b in snap.host] == host_ptrs


def test_a_changed_state_gets_new_buffers_only_where_it_changed():
    snap = DeviceSnapshot()
    snap.start(state())
    ts = state(seed=1)
    ts[0] = torch.randn(2000)
    snap.start(ts[:3])
    assert snap.wait().allocations == 1 and len(snap.host) == 3
    assert snap.digest() == digest_of(ts[:3])


def test_restore_refuses_a_state_it_does_not_fit():
    snap = DeviceSnapshot()
    snap.start(state())
    with pytest.raises(ValueError, match="4 tensors"):
        snap.restore(state()[:4])
    wrong = state()
    wrong[0] = torch.zeros(999)
    with pytest.raises(ValueError, match="does not fit"):
        snap.restore(wrong)


def test_digests_tell_bits_apart():
    a = [torch.tensor([0.0]), torch.tensor([1.0])]
    assert digest_of(a) == digest_of([t.clone() for t in a])
    assert digest_of(a) != digest_of([torch.tensor([-0.0]), torch.tensor([1.0])])   # -0.0 == 0.0, bits differ
    assert digest_of(a) != digest_of(a[::-1])


@needs_gpu
def test_cuda_snapshot_is_asynchronous_into_pinned_buffers_and_restores_exactly():
    ts = state("cuda")
    want = digest_of(ts)
    snap = DeviceSnapshot()
    snap.start(ts)
    snap.before_write()
    for t in ts:                       # queued after before_write: cannot race the copy
        t.zero_()
    assert snap.digest() == want and all(b.is_pinned() for b in snap.host)
    snap.restore(ts)
    assert digest_of(ts) == want
    snap.start(ts)
    assert snap.wait().allocations == 0 and snap.stats.seconds > 0


def test_a_snapshot_mixing_devices_is_refused():
    with pytest.raises(ValueError, match="one device"):
        DeviceSnapshot().start([torch.zeros(1), torch.zeros(1, device="meta")])
