"""NCCL generations (pg/nccl.py, GenerationGroup(backend="nccl")): the environment hotspare sets,
the device a rank binds to, the supervised wait; the NCCL runs themselves need a CUDA GPU."""
import datetime
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from hotspare.errors import PeerFailure
from hotspare.pg import GenerationGroup
from hotspare.pg.generation import SupervisedWork
from hotspare.pg.nccl import (DEFAULT_COLLECTIVE_TIMEOUT_S, REQUIRED, apply_nccl_environment,
                              collective_timeout, cuda_device, nccl_environment)

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()),
                               reason="needs a CUDA GPU: run bench/gpu_check.py on a GPU machine")


def test_the_environment_keeps_survivors_alive_and_bounds_the_rendezvous():
    env = nccl_environment(join_timeout_s=12.4)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"      # abort the communicator, not the process
    assert env["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert env["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "12"
    assert nccl_environment(0.2)["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "1"
    with pytest.raises(ValueError):
        nccl_environment(0)


def test_applying_it_replaces_dangerous_user_values_and_keeps_their_defaults():
    environ = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_DEBUG": "INFO", "PATH": "/bin"}
    replaced = apply_nccl_environment(environ, 30)
    assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and environ["NCCL_DEBUG"] == "INFO"
    assert environ["PATH"] == "/bin" and all(environ[k] == v for k, v in REQUIRED.items())
    assert len(replaced) == 1 and "TORCH_NCCL_ASYNC_ERROR_HANDLING=3 replaced by 2" in replaced[0]
    assert apply_nccl_environment(environ, 30) == []              # idempotent


def test_the_device_of_a_rank_and_the_timeouts():
    assert cuda_device("cuda:3") == torch.device("cuda", 3)
    assert cuda_device(None, local_rank=2) == torch.device("cuda", 2)
    for bad in ("cpu", "cuda"):
        with pytest.raises(ValueError, match="cuda:N"):
            cuda_device(bad)
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        cuda_device(None, None)
    assert collective_timeout(None, "nccl").total_seconds() == DEFAULT_COLLECTIVE_TIMEOUT_S == 60
    assert collective_timeout(None, "gloo").total_seconds() == 1800      # gloo: as before
    with pytest.raises(ValueError):
        collective_timeout(-1, "nccl")


def test_a_gloo_generation_is_built_as_before_and_nccl_ones_are_checked(monkeypatch):
    g = GenerationGroup(dist.HashStore(), gen=1, rank=0, world=1, prefix="g1/")
    assert (g.backend, g.device, g.timeout.total_seconds()) == ("gloo", None, 1800)
    with pytest.raises(ValueError, match="gloo' or 'nccl"):
        GenerationGroup(dist.HashStore(), 1, 0, 1, "g1/", backend="mpi")
    monkeypatch.setenv("LOCAL_RANK", "1")
    n = GenerationGroup(dist.HashStore(), 1, 0, 1, "g1/", backend="nccl")
    assert n.device == torch.device("cuda", 1) and n.timeout.total_seconds() == 60
    if not dist.is_nccl_available():
        with pytest.raises(ValueError, match="torch built with NCCL"):
            n.connect()
        assert not dist.is_initialized()


class NeverDone:
    """A work that never completes (a collective whose peer hangs): a test double."""

    def is_completed(self):
        return False

    def wait(self):
        raise AssertionError("the supervised wait must not block in work.wait()")


def test_the_supervised_wait_returns_raises_on_abort_and_aborts_on_timeout():
    g = GenerationGroup(dist.HashStore(), gen=1, rank=0, world=1, prefix="w1/")
    g.connect()
    try:
        t = torch.ones(4)
        g.wait(g.allreduce(t))
        assert torch.equal(t, torch.ones(4))
        with pytest.raises(PeerFailure, match="did not complete in 0.1 s"):
            g.wait(NeverDone(), timeout_s=0.1)
        assert g.aborted                                  # the timeout aborted the generation
    finally:
        g.destroy()
    h = GenerationGroup(dist.HashStore(), gen=2, rank=0, world=1, prefix="w2/")
    h.connect()
    try:
        threading.Timer(0.1, h.abort).start()             # the control thread, as a peer dies
        with pytest.raises(PeerFailure, match="aborted during a collective"):
            h.wait(NeverDone(), timeout_s=30)
    finally:
        h.destroy()
    assert not dist.is_initialized()



class Done:
    """A work that has completed (a collective whose peers all answered): a test double."""

    def __init__(self):
        self.waits = 0

    def is_completed(self):
        return True

    def wait(self):
        self.waits += 1
        return True


class NcclGroupDouble:
    """Stands in for the ProcessGroupNCCL that connect() builds on a GPU: its all-reduce never
    completes (a peer hangs mid-collective), its all-gather has completed; abort() is counted.
    A test double, never on the production path."""

    def __init__(self):
        self.aborts, self.gathered = 0, Done()

    def allreduce(self, tensors, opts):
        return NeverDone()

    def _allgather_base(self, out, tensor):
        return self.gathered

    def abort(self):
        self.aborts += 1


def test_a_hung_nccl_collective_is_aborted_on_its_deadline_by_the_runtimes_own_work_wait():
    """The runtime waits with plain ``work.wait()`` (gradient buckets, per-rank rows); on NCCL that
    call does not block the CPU, so the group's works must come back supervised: a collective
    that hangs raises PeerFailure on the generation's deadline and aborts the generation."""
    g = GenerationGroup(dist.HashStore(), 4, 0, 2, "s/", backend="nccl", device="cuda:0", timeout_s=0.2)
    pg = g._pg = NcclGroupDouble()       # what connect() would have built, on a GPU
    work = g.all_gather(torch.empty(2), torch.empty(1))
    assert isinstance(work, SupervisedWork)
    work.wait()                          # completed: returns, the backend's wait ran once
    assert pg.gathered.waits == 1 and not g.aborted
    work = g.allreduce(torch.ones(4))
    t0 = time.monotonic()
    with pytest.raises(PeerFailure, match="did not complete in 0.2 s"):
        work.wait()                      # NeverDone.wait would raise AssertionError: not called
    assert 0.15 < time.monotonic() - t0 < 5.0
    assert g.aborted and pg.aborts == 1 and not g.abort_stuck
    with pytest.raises(PeerFailure, match="was aborted"):
        g.allreduce(torch.ones(4))       # and the aborted generation never talks again


def test_a_supervised_nccl_wait_ends_when_another_thread_aborts_the_generation():
    g = GenerationGroup(dist.HashStore(), 5, 0, 2, "t/", backend="nccl", device="cuda:0")   # 60 s deadline
    g._pg = NcclGroupDouble()
    work = g.allreduce(torch.ones(4))
    threading.Timer(0.1, g.abort).start()          # the control thread: the coordinator saw a peer die
    t0 = time.monotonic()
    with pytest.raises(PeerFailure, match="aborted during a collective"):
        work.wait(datetime.timedelta(seconds=30))  # torch's signature: a timedelta
    assert time.monotonic() - t0 < 5.0


def test_gloo_works_are_torchs_own_unchanged():
    g = GenerationGroup(dist.HashStore(), gen=1, rank=0, world=1, prefix="u1/")
    g.connect()
    try:
        t = torch.arange(4.0)
        work = g.allreduce(t)
        assert not isinstance(work, SupervisedWork) and isinstance(work, dist.Work)
        work.wait()
        out = torch.empty(4)
        gathered = g.all_gather(out, t)
        assert isinstance(gathered, dist.Work)
        gathered.wait()
        assert torch.equal(out, torch.arange(4.0))
    finally:
        g.destroy()

@needs_gpu
def test_nccl_generations_are_created_aborted_and_rebuilt_in_process():
    store = dist.HashStore()
    for gen in (1, 2, 3):
        g = GenerationGroup(store, gen, 0, 1, f"gen{gen}/", backend="nccl", device="cuda:0")
        g.connect()
        x = torch.full((1024,), float(gen), device="cuda:0")
        g.wait(g.allreduce(x), timeout_s=30)
        assert bool((x == gen).all())
        g.abort()
        with pytest.raises(Exception):
            g.wait(g.allreduce(torch.ones(4, device="cuda:0")), timeout_s=10)
        g.destroy()
        assert not dist.is_initialized()
        assert float(torch.ones(4, device="cuda:0").sum()) == 4.0     # the process lives on
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"


class HangingNcclGroup:
    """Stands in for a ProcessGroupNCCL whose ncclCommAbort does not return (a peer stopped
    mid-collective): abort() blocks until released. A test double, never on the production path."""

    def __init__(self):
        self.release, self.calls = threading.Event(), 0

    def abort(self):
        self.calls += 1
        self.release.wait(30)


def test_an_nccl_abort_that_hangs_does_not_hang_the_caller_and_says_the_process_must_go():
    g = GenerationGroup(dist.HashStore(), 1, 0, 1, "h/", backend="nccl", device="cuda:0")
    g.abort_deadline_s = 0.2
    fake = HangingNcclGroup()
    g._pg = fake                       # what connect() would have built, on a GPU
    t0 = time.monotonic()
    g.abort()
    g.abort()                          # a second caller (the supervised wait) waits no longer
    assert time.monotonic() - t0 < 2.0 and fake.calls == 1
    assert g.aborted and g.abort_stuck
    with pytest.raises(PeerFailure, match="was aborted"):
        g.allreduce(torch.ones(1))     # an aborted NCCL generation never talks again
    g.destroy()                        # returns: it does not call the hanging abort again
    assert fake.calls == 1
    fake.release.set()
    deadline = time.monotonic() + 5
    while g.abort_stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not g.abort_stuck
