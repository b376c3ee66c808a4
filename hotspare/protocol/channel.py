"""A JSON-lines connection over a TCP socket: thread-safe sends, blocking line reads."""
from __future__ import annotations

import socket
import threading
from typing import Callable

from hotspare.errors import ProtocolError
from hotspare.protocol.messages import MAX_LINE, Message, decode, encode


class Channel:
    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._reader = sock.makefile("rb")
        self._send_lock = threading.Lock()
        self.closed = False

    @classmethod
    def connect(cls, host: str, port: int, timeout: float = 30.0) -> "Channel":
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.settimeout(None)
        return cls(sock)

    def send(self, msg: Message) -> None:
        data = encode(msg)
        with self._send_lock:
            self.sock.sendall(data)

    def recv(self) -> Message | None:
        """The next message, or None when the peer closed the connection."""
        line = self._reader.readline(MAX_LINE + 1)
        if not line:
            return None
        if not line.endswith(b"\n"):
            raise ProtocolError("control message too long or truncated")
        return decode(line)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def serve(server: socket.socket, handle: Callable[["Channel"], None], name: str) -> None:
    """Accept connections on ``server`` in a daemon thread, one daemon thread per connection
    running ``handle(channel)``; stops when the server socket is closed."""
    def accept() -> None:
        while True:
            try:
                sock, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(Channel(sock),), daemon=True).start()
    threading.Thread(target=accept, name=name, daemon=True).start()
