"""Listening for control connections with bounded resources.

``Listener`` accepts on a bound socket in a daemon thread and gives each connection a thread
of its own, in two stages:

1. ``handshake(channel)`` -- the connection has not proven who it is. At most ``max_pending``
   connections are in this stage at once; each line is at most ``hello_max_line`` bytes, and a
   reaper shuts down any that has not finished within ``deadline_s`` (a slowloris trickling
   bytes included).
2. ``handle(channel, hello)`` -- authenticated: lines up to ``max_line`` bytes, no deadline.

Why a flood cannot starve an honest peer: the accept loop takes every connection off the
kernel's backlog at once (nothing waits there behind a flood), and when all pending slots are
taken a newcomer is never turned away: the *oldest* pending connection of the source address
that holds the most pending ones is closed instead (``evict_choice``). A flood from one address
therefore evicts its own connections first; from the same address (a local user on loopback), a
newcomer keeps its slot until ``max_pending`` newer connections have arrived, far longer than
an honest handshake (one round trip and an HMAC) takes. Measured in docs/SECURITY.md.

A failed handshake is logged with the peer's address (at most ``LOG_BURST`` lines per
``LOG_WINDOW_S``, then a count, so a flood of connections cannot flood the log) and the
connection closed; an unexpected error in a handshake is such a refusal too, never a
traceback. The accept loop survives running out of file descriptors or threads (EMFILE, ENFILE,
ENOBUFS, ENOMEM): it logs, backs off and goes on serving; it ends only when the listening socket
is closed.
"""
from __future__ import annotations

import errno
import socket
import sys
import threading
import time
from typing import Any, Callable

from hotspare.errors import ProtocolError
from hotspare.protocol.auth import HELLO_MAX_LINE, HELLO_TIMEOUT_S
from hotspare.protocol.channel import Channel
from hotspare.protocol.messages import MAX_LINE

MAX_PENDING = 64              # unauthenticated connections at once, per listener
LOG_BURST, LOG_WINDOW_S = 20, 10.0
_SCARCE = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_TRANSIENT = {errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN}
_BACKOFF_S = (0.01, 1.0)


def _say(line: str) -> None:
    print(f"hotspare: {line}", file=sys.stderr, flush=True)


def bound_server(host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket bound to ``host`` only (IPv4 or IPv6 by its form)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=128)


class _RateLog:
    """At most ``burst`` lines per ``window`` seconds; the rest are counted and the count said
    with the next line let through."""

    def __init__(self, burst: int = LOG_BURST, window: float = LOG_WINDOW_S):
        self.burst, self.window = burst, window
        self._lock = threading.Lock()
        self._start, self._said, self._held = 0.0, 0, 0

    def say(self, line: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._start >= self.window:
                if self._held:
                    line = f"{line} ({self._held} more like it in the last {self.window:.0f} s not shown)"
                self._start, self._said, self._held = now, 0, 0
            if self._said >= self.burst:
                self._held += 1
                return
            self._said += 1
        _say(line)


def evict_choice(pending: list[tuple[object, str]]) -> object:
    """Which pending connection to close for a newcomer when every slot is taken: the oldest
    of the source that holds the most. ``pending``: (connection, source address), oldest first."""
    counts: dict[str, int] = {}
    for _, source in pending:
        counts[source] = counts.get(source, 0) + 1
    busiest = max(counts.values())
    return next(conn for conn, source in pending if counts[source] == busiest)


class Listener:
    def __init__(self, server: socket.socket, handshake: Callable[[Channel], Any],
                 handle: Callable[[Channel, Any], None], name: str, max_line: int = MAX_LINE,
                 max_pending: int = MAX_PENDING, deadline_s: float = HELLO_TIMEOUT_S,
                 hello_max_line: int = HELLO_MAX_LINE):
        self.server, self.name = server, name
        self._handshake, self._handle = handshake, handle
        self.max_line, self.hello_max_line, self.deadline_s = max_line, hello_max_line, deadline_s
        self.max_pending = max_pending
        self._pending: dict[Channel, tuple[float, str]] = {}   # channel -> (deadline, source); oldest first
        self._gone: dict[Channel, str] = {}       # taken out of pending by the reaper or an eviction: why
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._handshakes = threading.Event()    # set while a handshake may be pending: wakes the reaper
        self._refusals = _RateLog()
        self.evicted = 0                          # connections closed to make room, for tests and logs
        threading.Thread(target=self._accept_loop, name=name, daemon=True).start()
        threading.Thread(target=self._reap_loop, name=f"{name}-reaper", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self._handshakes.set()
        try:
            self.server.shutdown(socket.SHUT_RDWR)     # wakes the blocked accept (Linux)
        except OSError:
            pass
        self.server.close()

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    # ------------------------------------------------------------------ accepting
    def _accept_loop(self) -> None:
        backoff = _BACKOFF_S[0]
        while not self._closed.is_set():
            try:
                sock, address = self.server.accept()
            except OSError as e:
                if self._closed.is_set() or e.errno not in _SCARCE | _TRANSIENT:
                    return                      # the listening socket was closed
                if e.errno in _SCARCE:
                    _say(f"{self.name}: cannot accept a connection ({e.strerror}); retrying in {backoff:.2f} s")
                    time.sleep(backoff)
                    backoff = min(_BACKOFF_S[1], backoff * 2)
                continue
            backoff = _BACKOFF_S[0]
            source = str(address[0]) if isinstance(address, tuple) else "?"
            self._start(sock, source, f"{source}:{address[1]}" if isinstance(address, tuple) else "?")

    def _start(self, sock: socket.socket, source: str, who: str) -> None:
        try:
            ch = Channel(sock, max_line=self.hello_max_line)
        except OSError:
            sock.close()
            return
        with self._lock:
            victim = None
            if len(self._pending) >= self.max_pending:
                victim = evict_choice([(c, src) for c, (_, src) in self._pending.items()])
                del self._pending[victim]
                self._gone[victim] = (f"evicted unauthenticated: {self.max_pending} connections were "
                                      "waiting to prove themselves, this the oldest of the busiest address")
                self.evicted += 1
            self._pending[ch] = (time.monotonic() + self.deadline_s, source)
            self._handshakes.set()
        if victim is not None:
            victim.close()                      # its thread's read returns; it refuses
        try:
            threading.Thread(target=self._serve, args=(ch, who), name=f"{self.name}-conn", daemon=True).start()
        except RuntimeError as e:          # no thread to spare: this one is dropped, the loop goes on
            _say(f"{self.name}: dropping a connection: {e}")
            self._done_pending(ch)
            ch.close()

    def _done_pending(self, ch: Channel) -> str | None:
        """Take ``ch`` out of pending: None, or why it was already out (expired, evicted)."""
        with self._lock:
            if self._pending.pop(ch, None) is None:
                return self._gone.pop(ch, "closed")
        return None

    # ------------------------------------------------------------------ one connection
    def _serve(self, ch: Channel, who: str) -> None:
        try:
            hello = self._handshake(ch)
        except Exception as e:  # noqa: BLE001 -- whatever a handshake raises refuses this peer only
            gone = self._done_pending(ch)
            why = str(e) if isinstance(e, (OSError, ProtocolError, ValueError)) else \
                f"the handshake failed ({type(e).__name__}: {str(e)[:200]})"
            self._refusals.say(f"{self.name}: refused a connection from {who}: {gone or why}")
            ch.close()
            return
        if self._done_pending(ch) is not None:   # the reaper or an eviction was first: too late
            ch.close()
            return
        ch.max_line = self.max_line
        self._handle(ch, hello)

    def _reap_loop(self) -> None:
        # Asleep while no handshake is pending (a job's links are made once: no wake-ups then).
        while not self._closed.is_set():
            self._handshakes.wait()
            with self._lock:
                if not self._pending:
                    self._handshakes.clear()     # a later handshake sets it again, under this lock
                    continue
            if self._closed.wait(min(0.5, self.deadline_s / 4)):
                break
            now = time.monotonic()
            with self._lock:                    # taken out of pending here: a handshake that ends
                late = [ch for ch, (deadline, _) in self._pending.items() if deadline <= now]
                for ch in late:                 # now finds itself too late, and closes
                    del self._pending[ch]
                    self._gone[ch] = f"no hello within {self.deadline_s:.0f} s"
            for ch in late:
                ch.close()                      # its thread's read returns; it refuses
