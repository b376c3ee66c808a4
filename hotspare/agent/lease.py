"""The agent's side of its node lease: renew it, and fence this node the moment it runs out.

The lease is counted from when a renewal was *sent*, and only a renewal the coordinator
answered extends it; the coordinator counts from when it *received* that renewal and waits a
margin more (``hotspare.coordinator.lease``). So when this host is cut off, its agent kills its
own workers before the coordinator can have handed their ranks to spares on other hosts, and
nothing of the old generation runs on when the link comes back. Two threads: one sends the
renewals (a send may block on a dead link), the other only watches the clock, so fencing
never waits on the network.
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Callable

from hotspare.protocol.lease import period
from hotspare.protocol.messages import Message, make


def valid_until(sent_at: float, lease: float) -> float:
    """The lease an answered renewal sent at ``sent_at`` grants (monotonic time)."""
    return sent_at + lease


class AgentLease:
    """``send(msg)`` sends on the uplink; ``fence(silent_s)`` is called once, from this object's
    thread, when the lease has run out (``silent_s``: seconds since the last answered renewal was sent)."""

    def __init__(self, lease: float, send: Callable[[Message], None], fence: Callable[[float], None],
                 granted_at: float | None = None):
        """``granted_at``: when the first lease began, on this side (monotonic): before the hello
        went out, so before the coordinator can have started counting it."""
        self.lease = lease
        self._send, self._fence = send, fence
        self._seq = itertools.count()
        self._sent: dict[int, float] = {}
        self._lock = threading.Condition()
        self._granted_from = time.monotonic() if granted_at is None else granted_at
        self._until = valid_until(self._granted_from, lease)
        self._stopped = False
        self.fenced = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._renew_loop, name="lease-renew", daemon=True).start()
        threading.Thread(target=self._fence_loop, name="lease-fence", daemon=True).start()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()

    def renewed(self, msg: Message) -> None:
        """The coordinator answered renewal ``msg['seq']``."""
        with self._lock:
            sent = self._sent.pop(msg["seq"], None)
            for seq in [s for s in self._sent if s < msg["seq"]]:    # older ones cannot extend it further
                del self._sent[seq]
        if sent is not None:
            self.extend(sent)

    def extend(self, since: float) -> None:
        """Proof that no coordinator can have begun to count this node as lost before ``since``
        (monotonic): an answered renewal sent then, or, while the coordinator service is down,
        its host refusing a connection then (nothing listens: no coordinator runs to declare
        anyone lost, and a restarted one waits a whole lease for the agents to re-register)."""
        with self._lock:
            if not self.fenced.is_set() and valid_until(since, self.lease) > self._until:
                self._granted_from, self._until = since, valid_until(since, self.lease)
                self._lock.notify_all()

    def _renew_loop(self) -> None:
        every = period(self.lease)
        while True:
            with self._lock:
                if self._stopped or self.fenced.is_set():
                    return
                seq = next(self._seq)
                self._sent[seq] = time.monotonic()
            try:
                self._send(make("renew", seq=seq))
            except OSError:
                pass                 # the link is gone; the lease runs out and fences
            with self._lock:
                self._lock.wait_for(lambda: self._stopped or self.fenced.is_set(), timeout=every)

    def _fence_loop(self) -> None:
        with self._lock:
            while not self._stopped:
                left = self._until - time.monotonic()
                if left <= 0:
                    self.fenced.set()
                    silent = time.monotonic() - self._granted_from
                    break
                self._lock.wait(left)
            else:
                return
        self._fence(silent)
