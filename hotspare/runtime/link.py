"""A managed worker's link to its node agent: the control channel and its reader thread.

What the agent sends falls in three groups:

* **orders** the training thread waits for (``generation``, ``handoff``, ``release``,
  ``checkpoint_now``): queued, and taken by ``next_order`` (the phase machine's ``AwaitOrder``);
* **notes** that cannot wait for the training thread: ``abort`` and ``pause`` become the phase
  machine's ``Aborted`` / ``PauseAsked`` events, handed to ``on_note`` (runtime/driver.py
  ``WorkerDriver.notify``: an abort tears the generation's group down at once, which frees a rank
  blocked in a collective); ``probe`` (the job stalls) is answered with which step this rank is
  reducing;
* **plug-in messages**, handled by whoever registered for them with ``on`` (only the
  fault-injection plug-in, ``hotspare.testing.faults.worker``, does).

Anything else is logged and dropped: a message nobody expects never reaches the training loop.
"""
from __future__ import annotations

import queue
import sys
import threading
from typing import Any, Callable

from hotspare.errors import ProtocolError
from hotspare.protocol.auth import worker_connect
from hotspare.protocol.channel import Channel
from hotspare.protocol.messages import draft, make
from hotspare.runtime.phase import Aborted, Event, PauseAsked

ORDERS = frozenset({"generation", "handoff", "release", "checkpoint_now"})


class AgentLink:
    """The control channel of one worker. ``where`` answers a probe: (generation, rank, step
    being reduced or -1), or None before the worker has a rank."""

    def __init__(self, address: str, worker: str, role: str,
                 where: Callable[[], tuple[int, int, int] | None]):
        self.address, self.worker, self.role = address, worker, role
        self._where = where
        self._notes: list[Event] = []             # notes before on_note is set (kept, in order)
        self._on_note: Callable[[Event], None] = self._notes.append
        self._note_lock = threading.Lock()         # a note is kept or handed on, never lost between
        self._handlers: dict[str, Callable[[dict[str, Any]], None]] = {}
        self._orders: "queue.Queue[dict[str, Any]]" = queue.Queue()
        self._channel: Channel | None = None

    def on(self, type_: str, handler: Callable[[dict[str, Any]], None]) -> None:
        """Handle messages of ``type_`` on the reader thread (for plug-ins)."""
        if type_ in ORDERS or type_ in ("abort", "pause", "probe"):
            raise ValueError(f"{type_!r} is the link's own message")
        self._handlers[type_] = handler

    def on_note(self, fn: Callable[[Event], None]) -> None:
        """Call ``fn(event)`` from the reader thread for every abort and pause (first with the
        ones that came before)."""
        with self._note_lock:
            self._on_note = fn
            for event in self._notes:
                fn(event)
            self._notes = []

    def connect(self) -> None:
        """Say hello (proven with the worker's token) and start reading."""
        self._channel = worker_connect(self.address, self.worker, self.role)
        threading.Thread(target=self._read, name="hotspare-control", daemon=True).start()

    def send(self, type_: str, **fields: Any) -> None:
        self._channel.send(make(type_, **fields))

    def send_later(self, held: int, held_s: float, type_: str, **fields: Any) -> None:
        """Batched: goes out with the ``held``-th message or after ``held_s`` seconds, or with
        the next message sent at once; in order either way. Checked and encoded when it goes
        (``Channel.send_later``)."""
        self._channel.send_later(draft(type_, **fields), held, held_s)

    def try_send(self, type_: str, **fields: Any) -> None:
        """Send from a side thread, where a closed link only means nobody is left to tell."""
        if self._channel is None:
            return
        try:
            self.send(type_, **fields)
        except OSError:
            pass

    def next_order(self) -> dict[str, Any]:
        """Block for the next order (``generation``, ``handoff``, ``release``, ``checkpoint_now``)."""
        return self._orders.get()

    # ------------------------------------------------------------------ reader thread
    def _read(self) -> None:
        try:
            while True:
                msg = self._channel.recv()
                if msg is None:
                    break
                self._dispatch(msg)
        except (OSError, ProtocolError) as e:
            print(f"hotspare: control channel error: {e}", file=sys.stderr, flush=True)
        # The agent is gone: nothing can coordinate this worker any more.
        self._orders.put({"type": "release", "reason": "control channel closed"})

    def _note(self, event: Event) -> None:
        with self._note_lock:
            self._on_note(event)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind in ORDERS:
            self._orders.put(msg)
        elif kind == "abort":
            self._note(Aborted(int(msg["gen"])))
        elif kind == "pause":
            self._note(PauseAsked(int(msg["gen"])))
        elif kind == "probe":
            where = self._where()
            if where is not None and where[0] == msg["gen"]:
                self.send("reducing", gen=where[0], rank=where[1], step=where[2])
        elif kind in self._handlers:
            self._handlers[kind](msg)
        else:
            print(f"hotspare: worker {self.worker}: unexpected {kind!r} from the agent, dropped",
                  file=sys.stderr, flush=True)
