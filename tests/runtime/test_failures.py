"""A failed step is a peer's failure or the script's own error, judged by where the exception
was raised (runtime/failures.py), never by its message."""
import multiprocessing as mp
import os
import socket

import torch
import torch.distributed as dist

from hotspare.errors import PeerFailure
from hotspare.runtime.failures import Collectives, raised_in_torch_distributed


def _raise(exc):
    try:
        raise exc
    except BaseException as e:
        return e


def test_a_scripts_own_error_that_sounds_like_communication_is_the_scripts():
    c = Collectives()
    for text in ("DataLoader timed out", "connection reset by peer", "broken pipe", "NCCL error"):
        assert not c.is_peer_failure(_raise(RuntimeError(text)), group_aborted=False), text


def test_typed_failures_an_aborted_generation_and_noted_collectives_are_peer_failures():
    c = Collectives()
    assert c.is_peer_failure(_raise(PeerFailure("x")), group_aborted=False)
    assert c.is_peer_failure(_raise(dist.DistError("store")), group_aborted=False)
    assert c.is_peer_failure(_raise(ValueError("anything")), group_aborted=True)
    c.note(RuntimeError("bucket 3 failed"))
    assert c.is_peer_failure(_raise(ValueError("what backward raised")), group_aborted=False)
    c.clear()
    assert not c.is_peer_failure(_raise(ValueError("what backward raised")), group_aborted=False)


def _peer(port, ready):
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    dist.all_reduce(torch.ones(4))
    ready.wait(30)
    os._exit(1)                       # dies while rank 0 waits in its next collective


def test_a_collective_the_script_issues_fails_inside_torch_distributed_when_a_peer_dies():
    # The premise of the rule, on real gloo: a dead peer surfaces in the script's own
    # dist.all_reduce as a plain RuntimeError whose innermost frame is torch.distributed's.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    peer = ctx.Process(target=_peer, args=(port, ready), daemon=True)
    peer.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    try:
        dist.all_reduce(torch.ones(4))
        ready.set()
        try:
            dist.all_reduce(torch.ones(1 << 16))
            raise AssertionError("the collective survived its peer's death")
        except RuntimeError as e:
            err = e
        assert raised_in_torch_distributed(err), err
        assert Collectives().is_peer_failure(err, group_aborted=False)
    finally:
        peer.join(30)
        dist.destroy_process_group()
