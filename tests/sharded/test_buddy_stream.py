"""The buddy stream (transfer/buddy.py ``Stream``) between two real gloo processes: a packet is
one message once its size is known, a change of layout costs one note, what arrives is what was
sent, and a message that lies about its sizes is refused."""
from __future__ import annotations

import json
import os
import socket
import sys

import torch
import torch.multiprocessing as mp

from hotspare.transfer import buddy as wire


def _log(step: int, n: int, extra: dict | None = None) -> wire.Packet:
    g = torch.Generator().manual_seed(step)
    return wire.pack("log", step, [(("grad", 0), torch.randn(n, generator=g)), (("grad", 1), torch.arange(3.0))],
                     extra or {"groups": [{"lr": 0.1 / (step + 1)}]})


def _plan() -> list[tuple[int, int, dict | None]]:
    # (step, floats, extra): a steady run, a bigger layout, a header that outgrows its slot, back
    return ([(s, 1000, None) for s in range(4)] + [(4, 3000, None), (5, 3000, None)]
            + [(6, 3000, {"groups": [{"lr": 0.1, "note": "x" * 2000}]}), (7, 3000, None), (8, 1000, None)])


def _worker(rank: int, port: int, out: str, lie: bool) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, use_libuv=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    result: dict = {}
    try:
        if rank == 0:
            sent = []
            real_send = wire.dist.send
            wire.dist.send = lambda t, *a, **k: (sent.append(t.numel()), real_send(t, *a, **k))[1]
            st = wire.Stream(group, 1, tag=2)
            if lie:      # a message whose prefix does not add up to its size, after a note
                note = torch.zeros(wire.PREFIX, dtype=torch.uint8)
                note.view(torch.int64).copy_(torch.tensor([0, 0, 4096]))
                real_send(note, 1, group=group, tag=2)
                bad = torch.zeros(4096, dtype=torch.uint8)
                bad[:wire.PREFIX].view(torch.int64).copy_(torch.tensor([64, 10, 4096]))
                real_send(bad, 1, group=group, tag=2)
            else:
                for step, n, extra in _plan():
                    st.send(_log(step, n, extra))
            result = {"messages": sent}
        else:
            st = wire.Stream(group, 0, tag=2)
            got = []
            try:
                for _ in range(1 if lie else len(_plan())):
                    p = st.recv(wire.Buffers())
                    p.verify()
                    got.append([p.step, p.nbytes, p.extra, p.data.clone().tolist()[:8]])
            except wire.BadPacket as e:
                result["refused"] = str(e)
            result["got"] = got
        dist.barrier(group)
    finally:
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


def _run(tmp_path, lie: bool = False) -> tuple[dict, dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "r")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(port, out, lie), nprocs=2, start_method="spawn", join=True)
    return tuple(json.load(open(f"{out}.{r}")) for r in (0, 1))


def test_a_packet_is_one_message_once_its_size_is_known_and_arrives_whole(tmp_path):
    sender, receiver = _run(tmp_path)
    plan = _plan()
    assert [g[0] for g in receiver["got"]] == [s for s, _, _ in plan]
    for (step, n, extra), got in zip(plan, receiver["got"]):
        want = _log(step, n, extra)
        assert got[1] == want.nbytes and got[2] == want.extra
        assert got[3] == want.data[:8].tolist()
    # One message per packet, plus a note (of the size promised before) where the layout
    # changed: the first packet, the bigger log, the header outgrowing its slot, the smaller
    # log again. The slot never shrinks: the last log is bigger than the first.
    small, big = wire.PREFIX + wire.SLOT + 4012, wire.PREFIX + wire.SLOT + 12012
    wide = wire.PREFIX + 3 * wire.SLOT + 12012
    last = wide - 8000
    assert sender["messages"] == ([wire.PREFIX] + [small] * 4 + [small] + [big] * 2 + [big] + [wide] * 2
                                  + [wide, last]), sender["messages"]


def test_a_message_whose_sizes_do_not_add_up_is_refused(tmp_path):
    _, receiver = _run(tmp_path, lie=True)
    assert receiver["got"] == [] and "refused" in receiver["refused"], receiver


if __name__ == "__main__":
    sys.exit("run with pytest")
