"""A JSON-lines connection over a TCP socket: thread-safe sends (some held back to go out
together), blocking line reads of at most ``max_line`` bytes. Listening: ``hotspare.protocol.listen``."""
from __future__ import annotations

import socket
import threading
import time

from hotspare.errors import ProtocolError
from hotspare.protocol.messages import MAX_LINE, Message, decode, encode, validate


class Channel:
    def __init__(self, sock: socket.socket, max_line: int = MAX_LINE):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._reader = sock.makefile("rb")
        self._send_lock = threading.Lock()
        self._held: list[Message] = []    # messages waiting for the next send, not yet encoded
        self._held_since = 0.0
        self.closed = False
        self.max_line = max_line          # a longer line is refused (a listener lowers it until auth)

    @classmethod
    def connect(cls, host: str, port: int, timeout: float = 30.0) -> "Channel":
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.settimeout(None)
        return cls(sock)

    def send(self, msg: Message) -> None:
        """Send ``msg`` now, after any message held back by ``send_later`` (order is kept)."""
        data = encode(msg)
        with self._send_lock:
            self.sock.sendall(self._take_held() + data)

    def send_later(self, msg: Message, max_held: int, max_age_s: float) -> None:
        """Hold ``msg`` back and send it with the next ``send``, or with the held ones once
        ``max_held`` are waiting or the oldest has waited ``max_age_s``: one system call, and
        one wake-up of the reader, for several messages. ``msg`` may be a ``messages.draft``: the
        held messages are checked and encoded together when they go (one pass over warm code,
        not one per call: a worker's per-step commit reports, docs/BENCHMARKS.md)."""
        now = time.monotonic()
        with self._send_lock:
            if not self._held:
                self._held_since = now
            self._held.append(msg)
            if len(self._held) >= max_held or now - self._held_since >= max_age_s:
                self.sock.sendall(self._take_held())

    def _take_held(self) -> bytes:
        """The held messages, checked and encoded, and none held any more (one that fails its
        check raises ProtocolError here, and the rest held with it are dropped)."""
        held, self._held = self._held, []
        return b"".join(encode(validate(m)) for m in held)

    def recv(self, any_version: bool = False) -> Message | None:
        """The next message, or None when the connection is closed. A line longer than
        ``max_line`` closes it (what follows could not be framed). ``any_version``: a challenge
        or refusal of another protocol version is taken too (``messages.EVERY_VERSION``)."""
        if self.closed:
            return None
        line = self._reader.readline(self.max_line + 1)
        if not line:
            return None
        if not line.endswith(b"\n"):
            self.close()
            raise ProtocolError(f"control message longer than {self.max_line} bytes, or truncated")
        return decode(line, self.max_line, any_version)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

