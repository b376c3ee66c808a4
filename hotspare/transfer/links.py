"""Buddy links: the steady-state path of a sharded job's buddy snapshots and gradient logs
(transfer/buddy.py packets), one TCP connection per generation from each rank to its buddy.

Why not the generation's gloo group: every step each rank sends its buddy the step's gradient
log (4 bytes per sharded parameter) and receives its predecessor's. Through gloo (a send in a
thread, a receive, gloo's TCP loop thread between them) that exchange cost 4.5-7.4 ms of CPU a
step over four ranks on this machine's two cores; over one non-blocking socket pair driven by
the thread that waits for it anyway, 1.1-2.2 ms, for the same bytes (docs/BENCHMARKS.md). The
bytes go straight from the packed buffer to the socket and from the socket into the buffer the
buddy keeps: no frame, no copy. Restores after a failure still go over gloo (transfer/buddy.py
``send``/``recv``): they are rare, and between ranks that are not always a link's two ends.

Trust (docs/SECURITY.md): a link is proven both ways when it is made. The listener challenges
with a nonce; the dialing rank answers with HMAC(peer key, generation / its rank / the rank it
dials, nonce) and its own nonce; the listener accepts only its predecessor of the current
generation and answers that nonce the same way, so neither end sends its shard to, or takes a
packet from, anything that does not hold the job's peer key (``HOTSPARE_PEER_KEY``, handed to
each worker by its agent; protocol/auth.py). Like the control channels, an established
connection is bound to that identity for its life and its frames carry no MAC of their own; their
checksum (XXH3-64) guards against corruption. The listener binds to the address the job's gloo traffic uses
(``GLOO_SOCKET_IFNAME``'s, else the one that routes to ``MASTER_ADDR``: protocol/netif.py),
takes connections only while a generation makes its links, lets at most ``MAX_PENDING`` prove
themselves at once, each in its own thread within ``HELLO_TIMEOUT_S`` and ``MAX_HELLO`` bytes (a
silent one cannot hold the real predecessor up), and logs and drops one that fails.

A frame: [header length, byte count] (little-endian int64), the JSON header, the bytes. A link is
bound to its generation: ``adopt`` hands its socket to the generation, whose abort shuts it down,
so a rank blocked on a dead or hung peer is freed with the generation's collectives.
"""
from __future__ import annotations

import json
import os
import queue
import secrets
import select
import socket
import struct
import sys
import threading
import time
from typing import Callable

import torch

from hotspare.errors import PeerFailure
from hotspare.protocol import auth
from hotspare.protocol.netif import ipv4_of, source_address
from hotspare.transfer.buddy import MAX_BYTES, MAX_HEADER, BadPacket, Buffers, Packet, parse_header

HELLO_TIMEOUT_S = 5.0      # a connection proves itself within this (honest ones take milliseconds)
MAX_HELLO = 1024           # bytes of a handshake line
IOV_MAX = 512              # buffers per sendmsg (Linux allows 1024)
MAX_PENDING = 8            # connections proving themselves at once while links are made
ACCEPT_POLL_S = 0.05       # how often the accept loop looks for a proven connection
POLL_S = 0.5               # how often a blocked exchange looks whether its generation was aborted
PREFIX = struct.Struct("<qq")
KEY = "hotspare_link/{rank}"      # in the generation's store: where rank's listener is


def bind_host(env=os.environ) -> str:
    """The address gloo's traffic uses on this host: ``GLOO_SOCKET_IFNAME``'s IPv4 address, else
    the local address that routes to ``MASTER_ADDR``."""
    ifname = env.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if ifname:
        addr = ipv4_of(ifname)
        if addr is None:
            raise PeerFailure(f"GLOO_SOCKET_IFNAME={ifname!r} has no IPv4 address for a buddy link")
        return addr
    return source_address(env.get("MASTER_ADDR", "127.0.0.1"))


def _say(msg: str) -> None:
    print(f"hotspare: {msg}", file=sys.stderr, flush=True)


def _identity(gen: int, src: int, dst: int) -> str:
    return f"{gen}/{src}/{dst}"


def _read_line(sock: socket.socket, deadline: float) -> dict:
    """One JSON line of at most ``MAX_HELLO`` bytes, and nothing after it (a handshake is one
    message each way: the peer says nothing more until answered)."""
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise auth.AuthError("said nothing in time")
        sock.settimeout(left)
        try:
            got = sock.recv(MAX_HELLO + 1 - len(buf))
        except socket.timeout:
            raise auth.AuthError("said nothing in time") from None
        if not got:
            raise auth.AuthError("closed the connection")
        buf += got
        if len(buf) > MAX_HELLO or (b"\n" in buf and not buf.endswith(b"\n")):
            raise auth.AuthError("a handshake line too long, or more than one")
    try:
        msg = json.loads(buf)
    except ValueError:
        raise auth.AuthError("a handshake line that is not JSON") from None
    if not isinstance(msg, dict):
        raise auth.AuthError("a handshake line that is not a JSON object")
    return msg


def _send_line(sock: socket.socket, msg: dict) -> None:
    sock.sendall(json.dumps(msg).encode() + b"\n")


class Listener:
    """A worker's buddy-link listener (one for its life; connections are taken only while a
    generation makes its links: ``accept_from``)."""

    def __init__(self, host: str):
        self.sock = socket.create_server((host, 0), backlog=8)
        self.address = "%s:%d" % self.sock.getsockname()[:2]

    def accept_from(self, key: str, gen: int, pred: int, me: int, deadline: float,
                    aborted: Callable[[], bool]) -> socket.socket:
        """The connection of rank ``pred`` of generation ``gen`` to this rank, proven; any other
        is logged and dropped. Connections prove themselves side by side, each in a thread of its
        own (at most ``MAX_PENDING`` at once; more are closed at once), so a silent or trickling
        one cannot hold the real one up."""
        proven: queue.Queue = queue.Queue()
        done = threading.Event()
        pending = [0]
        lock = threading.Lock()

        def prove(conn: socket.socket, peer) -> None:
            try:
                self._prove(conn, key, gen, pred, me)
                conn.settimeout(None)
                with lock:
                    keep = not done.is_set()
                    if keep:
                        proven.put(conn)
                if not keep:
                    conn.close()
            except (auth.AuthError, OSError) as e:
                _say(f"rank {me}: buddy link: refused a connection from {peer[0]}:{peer[1]}: {e}")
                conn.close()
            finally:
                with lock:
                    pending[0] -= 1

        try:
            while True:
                try:
                    return proven.get_nowait()
                except queue.Empty:
                    pass
                left = deadline - time.monotonic()
                if aborted():
                    raise PeerFailure("the generation was aborted while its buddy links were made")
                if left <= 0:
                    raise PeerFailure(f"rank {pred} did not link to rank {me} (generation {gen}) in time")
                self.sock.settimeout(min(left, ACCEPT_POLL_S))
                try:
                    conn, peer = self.sock.accept()
                except socket.timeout:
                    continue
                with lock:
                    busy = pending[0] >= MAX_PENDING
                    if not busy:
                        pending[0] += 1
                if busy:
                    _say(f"rank {me}: buddy link: refused a connection from {peer[0]}:{peer[1]}: "
                         f"{MAX_PENDING} others are still proving themselves")
                    conn.close()
                    continue
                threading.Thread(target=prove, args=(conn, peer), daemon=True,
                                 name="hotspare-link-prove").start()
        finally:
            with lock:
                done.set()

    @staticmethod
    def _prove(conn: socket.socket, key: str, gen: int, pred: int, me: int) -> None:
        until = time.monotonic() + HELLO_TIMEOUT_S
        nonce = secrets.token_hex(16)
        _send_line(conn, {"challenge": nonce})
        hello = _read_line(conn, until)
        claim = (hello.get("generation"), hello.get("from"), hello.get("to"))
        if claim != (gen, pred, me):
            raise auth.AuthError(f"it says it is generation/from/to {claim}, expected {(gen, pred, me)}")
        theirs = hello.get("nonce")
        if not (isinstance(theirs, str) and 16 <= len(theirs) <= 64 and isinstance(hello.get("proof"), str)):
            raise auth.AuthError("a malformed hello")
        if not auth.verify(key, "link-dial", _identity(gen, pred, me), nonce, hello["proof"]):
            raise auth.AuthError("its proof is wrong")
        _send_line(conn, {"proof": auth.proof(key, "link-accept", _identity(gen, pred, me), theirs)})

    def close(self) -> None:
        self.sock.close()


def dial(address: str, key: str, gen: int, me: int, buddy: int, deadline: float) -> socket.socket:
    """A proven connection from this rank to ``buddy``'s listener at ``address``."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=max(0.1, deadline - time.monotonic()))
    try:
        until = min(deadline, time.monotonic() + HELLO_TIMEOUT_S)
        challenge = _read_line(sock, until).get("challenge")
        if not (isinstance(challenge, str) and 16 <= len(challenge) <= 64):
            raise auth.AuthError("no challenge")
        nonce = secrets.token_hex(16)
        who = _identity(gen, me, buddy)
        _send_line(sock, {"generation": gen, "from": me, "to": buddy, "nonce": nonce,
                          "proof": auth.proof(key, "link-dial", who, challenge)})
        answer = _read_line(sock, until).get("proof")
        if not (isinstance(answer, str) and auth.verify(key, "link-accept", who, nonce, answer)):
            raise auth.AuthError(f"{address} did not prove it is rank {buddy}'s buddy link")
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


class Links:
    """This rank's two links of one generation: ``out`` to its buddy, ``inn`` from its
    predecessor. One thread uses them at a time."""

    def __init__(self, out: socket.socket, inn: socket.socket, pred: int, buddy: int,
                 aborted: Callable[[], bool]):
        self.out, self.inn, self.pred, self.buddy = out, inn, pred, buddy
        self._aborted = aborted
        for s in (out, inn):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(False)
        self._poll = select.poll()

    def exchange(self, packet: Packet | None, buffers: Buffers | None = None,
                 receive: bool = True) -> Packet | None:
        """Send ``packet`` to the buddy and receive the predecessor's next one, at once (every
        rank of the ring does both: neither may wait for the other). Its header is checked; its
        bytes land in a buffer of ``buffers`` and are verified by whoever keeps or loads them."""
        parts: list[memoryview] = []
        if packet is not None:
            head = packet.header()
            parts = [memoryview(PREFIX.pack(len(head), packet.nbytes) + head)]
            if packet.views is not None:
                parts += [v.cast("B") for v in packet.views]
            elif packet.nbytes:
                parts.append(memoryview(packet.data.numpy()).cast("B"))
        rx = _Receiver(buffers) if receive else None
        poll = self._poll
        out_fd, in_fd = self.out.fileno(), self.inn.fileno()
        if rx is not None:
            poll.register(in_fd, select.POLLIN)
        try:
            if parts:
                poll.register(out_fd, select.POLLOUT)
                self._send_some(parts)     # most of it often fits the socket's buffer at once
            while parts or (rx is not None and not rx.done):
                events = poll.poll(POLL_S * 1000)
                if not events and self._aborted():
                    raise PeerFailure("the generation was aborted during a buddy exchange")
                for fd, _ in events:
                    if fd == out_fd:
                        self._send_some(parts)
                    elif fd == in_fd:
                        try:
                            rx.read(self.inn, self.pred)
                        except OSError as e:
                            raise PeerFailure(f"the buddy link from rank {self.pred}: {e}") from e
                if not parts:
                    self._forget(out_fd)
                if rx is not None and rx.done:
                    self._forget(in_fd)
        finally:
            self._forget(out_fd)
            self._forget(in_fd)
        return rx.packet() if rx is not None else None

    def _forget(self, fd: int) -> None:
        try:
            self._poll.unregister(fd)
        except KeyError:
            pass

    def _send_some(self, parts: list[memoryview]) -> None:
        """Send what the socket takes now: every part in one system call (``sendmsg``, a
        packet's header and each of its tensors), not one call per tensor."""
        while parts:
            try:
                n = self.out.sendmsg(parts[:IOV_MAX])
            except BlockingIOError:
                return
            except OSError as e:
                raise PeerFailure(f"the buddy link to rank {self.buddy}: {e}") from e
            while n:
                if n >= parts[0].nbytes:
                    n -= parts.pop(0).nbytes
                else:
                    parts[0], n = parts[0][n:], 0

    def close(self) -> None:
        for s in (self.out, self.inn):
            try:
                s.close()
            except OSError:
                pass


class _Receiver:
    """One frame read in pieces as they arrive: the prefix, the header, the bytes."""

    def __init__(self, buffers: Buffers | None):
        self._buffers = buffers
        self._prefix = bytearray(PREFIX.size)
        self._view = memoryview(self._prefix)
        self._stage = 0             # 0 prefix, 1 header, 2 bytes, 3 done
        self._head = bytearray()
        self._h: dict | None = None
        self._data = None
        self._nbytes = 0

    @property
    def done(self) -> bool:
        return self._stage == 3

    def read(self, sock: socket.socket, pred: int) -> None:
        while self._stage < 3:
            if len(self._view):
                try:
                    n = sock.recv_into(self._view)
                except BlockingIOError:
                    return
                if n == 0:
                    raise PeerFailure(f"rank {pred} closed its buddy link")
                self._view = self._view[n:]
            if not len(self._view):
                self._next()

    def _next(self) -> None:
        if self._stage == 0:
            hlen, nbytes = PREFIX.unpack(self._prefix)
            if not (0 < hlen <= MAX_HEADER and 0 <= nbytes <= MAX_BYTES):
                raise BadPacket(f"a buddy link frame of {hlen}/{nbytes} bytes announced: refused")
            self._nbytes = nbytes
            self._head = bytearray(hlen)
            self._view, self._stage = memoryview(self._head), 1
        elif self._stage == 1:
            self._h = parse_header(bytes(self._head), self._nbytes)
            b = self._buffers
            self._data = b.take(self._nbytes) if b is not None else torch.empty(self._nbytes, dtype=torch.uint8)
            self._view, self._stage = memoryview(self._data.numpy()).cast("B"), 2
            if not self._nbytes:
                self._stage = 3
        else:
            self._stage = 3

    def packet(self) -> Packet:
        h = self._h
        return Packet(h["kind"], h["step"], h["entries"], self._data, h["xxh3"], h["extra"])


def link_up(listener: Listener, store, key: str, gen: int, me: int, buddy: int, pred: int,
            timeout_s: float, aborted: Callable[[], bool],
            adopt: Callable[[socket.socket], None] = lambda s: None) -> Links:
    """Every rank of generation ``gen`` at once: publish this rank's listener in the generation's
    ``store``, dial ``buddy``'s and take ``pred``'s connection, both proven."""
    store.set(KEY.format(rank=me), listener.address)
    deadline = time.monotonic() + timeout_s
    got: dict[str, object] = {}

    def dialing() -> None:
        try:
            address = store.get(KEY.format(rank=buddy)).decode()
            got["out"] = dial(address, key, gen, me, buddy, deadline)
        except BaseException as e:        # noqa: BLE001 - raised below, on the caller's thread
            got["error"] = e

    t = threading.Thread(target=dialing, name="hotspare-link-dial", daemon=True)
    t.start()
    inn = None
    try:
        inn = listener.accept_from(key, gen, pred, me, deadline, aborted)
        adopt(inn)
        t.join(max(0.0, deadline - time.monotonic()) + HELLO_TIMEOUT_S)
        if "out" not in got:
            e = got.get("error")
            why = f"{type(e).__name__}: {e}" if isinstance(e, BaseException) else "not in time"
            raise PeerFailure(f"rank {me} could not link to its buddy rank {buddy}: {why}")
    except BaseException:
        if inn is not None:
            inn.close()
        t.join(HELLO_TIMEOUT_S)
        if isinstance(got.get("out"), socket.socket):
            got["out"].close()
        raise
    out = got["out"]
    adopt(out)
    return Links(out, inn, pred, buddy, aborted)


__all__ = ["Links", "Listener", "bind_host", "dial", "link_up"]
