"""Buddy links (transfer/links.py): real sockets on loopback and torch's real TCPStore, ranks as
threads. A ring links up and moves packets byte for byte (larger than a socket's buffer, so in
pieces); a connection that cannot prove it holds the job's peer key, or claims another rank or
generation, is refused and logged while the real one links; a listener that cannot prove it is
sent nothing; a peer that dies, lies about a frame or goes silent is a PeerFailure, the last one
as soon as the generation is aborted."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from hotspare.errors import PeerFailure
from hotspare.pg.generation import GenerationGroup
from hotspare.protocol import auth
from hotspare.transfer import buddy as wire
from hotspare.transfer import links

KEY = auth.peer_key(b"k" * 32)


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, use_libuv=False)
    yield dist.PrefixStore("gen7/", server)


def _client(store) -> dist.Store:
    """A store client of its own, as each worker has (one client's blocking get holds it)."""
    server = store.underlying_store
    return dist.PrefixStore("gen7/", dist.TCPStore(server.host, server.port, is_master=False, use_libuv=False))


def _packet(step: int, n: int, seed: int) -> wire.Packet:
    g = torch.Generator().manual_seed(seed)
    return wire.pack("log", step, [(("grad", 0), torch.randn(n, generator=g)), (("grad", 1), torch.arange(5.0))],
                     {"groups": [{"lr": 0.1}]})


def _view(step: int, n: int, seed: int) -> wire.Packet:
    g = torch.Generator().manual_seed(seed)
    return wire.view("log", step, [(("grad", 0), torch.randn(n, generator=g)), (("grad", 1), torch.arange(5.0))],
                     {"groups": [{"lr": 0.1}]})


def test_a_view_checksums_and_sends_what_a_copy_would():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(40, generator=g)
    tensors = [(("a",), base[::2]),                                   # strided: sent as a contiguous copy
               (("b",), torch.randn(3, 4, generator=g)),
               (("c",), torch.tensor(7.0)),                            # 0-dim
               (("d",), torch.randn(6, generator=g).to(torch.bfloat16)),   # a dtype numpy lacks
               (("e",), torch.empty(0)),
               (("f",), torch.arange(5, dtype=torch.int64))]
    copy, v = wire.pack("state", 2, tensors), wire.view("state", 2, tensors)
    assert (v.entries, v.digest, v.nbytes) == (copy.entries, copy.digest, copy.nbytes)
    assert b"".join(bytes(x) for x in v.views) == bytes(copy.data.numpy())


def _ring(store, world: int, key=KEY, gen: int = 7, timeout_s: float = 10.0, aborted=lambda: False):
    """Every rank links up at once (threads); returns (listeners, links by rank)."""
    listeners = [links.Listener("127.0.0.1") for _ in range(world)]
    made: dict[int, object] = {}

    def one(r: int) -> None:
        try:
            made[r] = links.link_up(listeners[r], _client(store), key, gen, r, (r + 1) % world, (r - 1) % world,
                                    timeout_s, aborted)
        except BaseException as e:     # noqa: BLE001
            made[r] = e

    ts = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return listeners, made


def _exchange_all(made: dict, packets: dict[int, wire.Packet]) -> dict[int, wire.Packet]:
    got: dict[int, object] = {}

    def one(r: int) -> None:
        try:
            got[r] = made[r].exchange(packets[r], wire.Buffers())
        except BaseException as e:     # noqa: BLE001
            got[r] = e

    ts = [threading.Thread(target=one, args=(r,)) for r in made]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return got


def test_a_ring_of_four_links_up_and_moves_packets_byte_for_byte(store):
    _, made = _ring(store, 4)
    assert all(isinstance(m, links.Links) for m in made.values()), made
    for step, n, copy in ((0, 1000, True), (1, 1_500_000, False), (2, 3, False), (3, 0, False)):
        # 6 MB: far beyond a socket's buffer; sent as a copy (``pack``) or from the tensors' own memory (``view``)
        packed = {r: _packet(step, n, seed=10 * r + step) for r in range(4)}
        sent = packed if copy else {r: _view(step, n, seed=10 * r + step) for r in range(4)}
        got = _exchange_all(made, sent)
        for r in range(4):
            p = got[r]
            assert isinstance(p, wire.Packet), p
            src = packed[(r - 1) % 4]
            p.verify()
            assert (p.kind, p.step, p.entries, p.extra, p.digest) == (src.kind, src.step, src.entries, src.extra,
                                                                     src.digest)
            assert torch.equal(p.data, src.data)


def _intruder(address: str, hello) -> str:
    """Connect to a listener and answer its challenge with ``hello(challenge)``; what came back."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        challenge = json.loads(s.makefile().readline())["challenge"]
        if hello is not None:
            s.sendall(json.dumps(hello(challenge)).encode() + b"\n")
        s.settimeout(5)
        try:
            return s.recv(4096).decode()
        except OSError as e:
            return f"error {e}"


def test_connections_that_cannot_prove_they_are_the_predecessor_are_refused_and_logged(store, capsys, monkeypatch):
    monkeypatch.setattr(links, "HELLO_TIMEOUT_S", 0.5)
    listener = links.Listener("127.0.0.1")
    store.set("hotspare_link/0", "unused")
    answers: list[str] = []
    wrong_key = auth.peer_key(b"x" * 32)
    attempts = [
        lambda c: {"generation": 7, "from": 0, "to": 1, "nonce": "a" * 32,
                   "proof": auth.proof(wrong_key, "link-dial", "7/0/1", c)},           # not the job's key
        lambda c: {"generation": 7, "from": 3, "to": 1, "nonce": "a" * 32,
                   "proof": auth.proof(KEY, "link-dial", "7/3/1", c)},                 # a rank that is not its predecessor
        lambda c: {"generation": 6, "from": 0, "to": 1, "nonce": "a" * 32,
                   "proof": auth.proof(KEY, "link-dial", "6/0/1", c)},                 # an old generation
        None,                                                                          # says nothing
    ]

    def intrude() -> None:
        for hello in attempts:
            answers.append(_intruder(listener.address, hello))
        # then the real predecessor, rank 0 of generation 7
        answers.append("linked" if links.dial(listener.address, KEY, 7, 0, 1, time.monotonic() + 5) else "")

    t = threading.Thread(target=intrude)
    t.start()
    conn = listener.accept_from(KEY, 7, 0, 1, time.monotonic() + 20, lambda: False)
    t.join(10)
    conn.close()
    assert answers[:4] == ["", "", "", ""], answers        # closed: no proof was ever sent back
    assert answers[4] == "linked"
    err = capsys.readouterr().err
    assert err.count("buddy link: refused a connection") == 4, err
    assert "its proof is wrong" in err and "(7, 3, 1)" in err and "(6, 0, 1)" in err and "in time" in err


def test_silent_connections_queued_first_do_not_hold_the_real_one_up(capsys, monkeypatch):
    monkeypatch.setattr(links, "HELLO_TIMEOUT_S", 2.0)
    listener = links.Listener("127.0.0.1")
    host, port = listener.address.rsplit(":", 1)
    silent = [socket.create_connection((host, int(port))) for _ in range(3)]     # in the backlog first
    t = threading.Thread(target=lambda: links.dial(listener.address, KEY, 7, 0, 1, time.monotonic() + 10))
    t.start()
    t0 = time.monotonic()
    conn = listener.accept_from(KEY, 7, 0, 1, time.monotonic() + 20, lambda: False)
    took = time.monotonic() - t0
    t.join(10)
    assert took < 1.5, took          # not 3 x 2 s: each connection proves itself on its own
    conn.close()
    time.sleep(2.5)
    for s in silent:
        s.close()
    assert capsys.readouterr().err.count("said nothing in time") == 3


def test_a_listener_that_cannot_prove_it_is_the_buddy_is_sent_nothing():
    srv = socket.create_server(("127.0.0.1", 0))
    seen = []

    def impostor() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.sendall(json.dumps({"challenge": "c" * 32}).encode() + b"\n")
            hello = json.loads(conn.makefile().readline())
            conn.sendall(json.dumps({"proof": auth.proof(auth.peer_key(b"x" * 32), "link-accept", "7/0/1",
                                                         hello["nonce"])}).encode() + b"\n")
            conn.settimeout(2)
            try:
                seen.append(conn.recv(1 << 20))
            except OSError:
                seen.append(b"")

    t = threading.Thread(target=impostor)
    t.start()
    with pytest.raises(auth.AuthError, match="did not prove"):
        links.dial("127.0.0.1:%d" % srv.getsockname()[1], KEY, 7, 0, 1, time.monotonic() + 5)
    t.join(10)
    assert seen == [b""]


def test_a_silent_peer_frees_the_exchange_when_the_generation_is_aborted(store):
    gen = GenerationGroup(store, 7, 0, 2, "g7/")
    listeners, made = _ring(store, 2, aborted=lambda: gen.aborted)
    a = made[0]
    gen.adopt(a.out)
    gen.adopt(a.inn)
    threading.Timer(0.3, gen.abort).start()
    t0 = time.monotonic()
    with pytest.raises(PeerFailure):
        a.exchange(_packet(0, 10, 0), wire.Buffers())      # rank 1 never sends
    assert time.monotonic() - t0 < 5


def test_the_abort_flag_alone_frees_it_too(store):
    flag = threading.Event()
    _, made = _ring(store, 2, aborted=flag.is_set)
    threading.Timer(0.2, flag.set).start()
    with pytest.raises(PeerFailure, match="aborted"):
        made[0].exchange(_packet(0, 10, 0), wire.Buffers())


def _raw_frame(link: links.Links, header: dict, data: bytes) -> None:
    head = json.dumps(header).encode()
    link.out.setblocking(True)
    link.out.sendall(links.PREFIX.pack(len(head), len(data)) + head + data)


def test_a_frame_that_lies_about_its_bytes_is_refused(store):
    _, made = _ring(store, 2)
    _raw_frame(made[0], {"kind": "log", "step": 1, "entries": [[["g"], "float32", [4]]], "xxh3": 0, "extra": {}},
               b"\0" * 8)
    with pytest.raises(wire.BadPacket, match="describes 16 bytes, 8 announced"):
        made[1].exchange(None, wire.Buffers())


def test_a_peer_that_dies_mid_frame_is_a_peer_failure(store):
    _, made = _ring(store, 2)
    p = _packet(0, 100_000, 0)
    head = p.header()
    made[0].out.setblocking(True)
    made[0].out.sendall(links.PREFIX.pack(len(head), p.nbytes) + head + bytes(p.data[:1000].numpy()))
    made[0].close()
    with pytest.raises(PeerFailure, match="closed its buddy link|buddy link"):
        made[1].exchange(_packet(0, 10, 1), wire.Buffers())


def test_the_listener_binds_where_gloo_goes(monkeypatch):
    assert links.bind_host({"GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"
    assert links.bind_host({"MASTER_ADDR": "127.0.0.1"}) == "127.0.0.1"
    with pytest.raises(PeerFailure, match="no IPv4"):
        links.bind_host({"GLOO_SOCKET_IFNAME": "nosuchif0"})
