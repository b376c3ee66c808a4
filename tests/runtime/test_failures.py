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


def _rank(rank, port, ready, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        ready.wait(30)
        os._exit(1)                   # dies while rank 0 waits in its next collective
    ready.set()
    try:
        dist.all_reduce(torch.ones(1 << 16))
        results.put("the collective survived its peer's death")
    except RuntimeError as e:
        results.put((type(e).__name__, raised_in_torch_distributed(e),
                     Collectives().is_peer_failure(e, group_aborted=False)))
    results.close()
    results.join_thread()             # flushed before the abrupt exit (gloo's threads are still up)
    os._exit(0)


def test_a_collective_the_script_issues_fails_inside_torch_distributed_when_a_peer_dies():
    # The premise of the rule, on real gloo: a dead peer surfaces in the script's own
    # dist.all_reduce as a plain RuntimeError whose innermost frame is torch.distributed's.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    ready, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, ready, results), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        assert results.get(timeout=60) == ("RuntimeError", True, True)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
