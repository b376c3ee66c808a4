"""An in-process link between the launcher's own node agent and its coordinator.

A remote node agent talks to the coordinator over an authenticated TCP channel
(protocol/channel.py); ``hotspare run``'s local agents live in the launcher's process, where a
socket, and the JSON that crosses it twice, buy nothing: there is no one to authenticate and
no byte to frame. ``local_pair()`` gives the two ends of a link with a ``Channel``'s calls
(``send``, ``send_later``, ``recv``, ``close``, ``closed``), over two queues.

What crosses is what would have crossed the socket, message by message, in order, with the same
checks at the receiving end: every message is encoded and decoded (``messages.encode`` /
``decode``, the schema included) exactly as on a socket, except a ``relay`` (a worker's message,
which the agent read off the worker's socket and checked already: it is JSON by construction),
passed as it is. Relays are nearly all of a running job's traffic (every rank's commits), and
each saved an encode, a decode and two system calls in the launcher: about 75 us each here
(docs/BENCHMARKS.md). The coordinator still decodes a relay into its typed event
(``coordinator.events.decode``) and refuses a worker its node does not run, as for a remote node.
"""
from __future__ import annotations

import queue
from typing import Any

from hotspare.protocol.messages import MAX_LINE, Message, decode, encode

_END = None          # what a closed end leaves for the other one to read: end of stream


class LocalChannel:
    def __init__(self, inbox: "queue.SimpleQueue[Any]", outbox: "queue.SimpleQueue[Any]", name: str):
        self._in, self._out, self.name = inbox, outbox, name
        self.closed = False

    def __repr__(self) -> str:
        return f"LocalChannel({self.name})"

    def send(self, msg: Message) -> None:
        """Hand ``msg`` to the other end (OSError once either end closed, as a socket's would)."""
        if self.closed:
            raise OSError(f"in-process link {self.name} is closed")
        self._out.put(msg if msg.get("type") == "relay" else encode(msg))

    def send_later(self, msg: Message, max_held: int, max_age_s: float) -> None:
        self.send(msg)                     # nothing to batch: no system call to save

    def recv(self, any_version: bool = False) -> Message | None:
        """The next message, or None once the other end (or this one) closed."""
        if self.closed:
            return None
        item = self._in.get()
        if item is _END:
            self.closed = True
            return None
        return item if isinstance(item, dict) else decode(item, 2 * MAX_LINE, any_version)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._out.put(_END)                # the other end reads end of stream
        self._in.put(_END)                 # and a reader of this end wakes up to it


def local_pair(name: str = "local") -> tuple[LocalChannel, LocalChannel]:
    """The two ends of one in-process link: (the agent's, the coordinator's)."""
    a, b = queue.SimpleQueue(), queue.SimpleQueue()
    return LocalChannel(a, b, f"{name}:agent"), LocalChannel(b, a, f"{name}:coordinator")


__all__ = ["LocalChannel", "local_pair"]
