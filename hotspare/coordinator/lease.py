"""Node leases: how the coordinator tells a dead or cut-off host from a quiet one.

A node agent that connected over the network (``hotspare agent``) renews its lease every
``hotspare.protocol.lease.period(lease)`` seconds with ``renew``; the coordinator answers ``renewed``. A node whose
link closes is lost at once (the endpoint says so); one whose link stays open but whose
renewals stop (power loss, kernel panic, a link taken down: no FIN ever arrives) is declared
lost once ``overdue``: no renewal *received* for ``lease + margin`` seconds.

Why this cannot split the brain: the agent counts its lease from when it *sent* the renewal
that was answered, which is no later than when the coordinator received it, and it kills its
own workers the moment that lease runs out (``hotspare.agent.lease``). So the agent fences at
least ``margin`` seconds before the coordinator can declare the node lost and hand its ranks to
spares elsewhere: when the link heals, nothing of the old generation is left to speak. Both
sides use their own monotonic clock; only their rates must agree, not their times.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from hotspare.protocol.channel import Channel

DEFAULT_MARGIN_S = 1.0


def overdue(last_renewal: float, now: float, lease: float, margin: float) -> bool:
    """Is a node whose last renewal arrived at ``last_renewal`` lost at ``now``?"""
    return now - last_renewal > lease + margin


@dataclass
class _Held:
    node: str
    channel: Channel
    last: float          # monotonic time of the last renewal received (or of the hello)


class Leases:
    """The leases of the nodes on one endpoint. ``on_expire(node, channel, silent_s)`` is called
    (from this object's thread, once per link) when a lease is overdue; the link is then
    released here, so its close that follows is not reported a second time."""

    def __init__(self, lease: float, margin: float, on_expire: Callable[[str, Channel, float], None]):
        if lease <= 0 or margin < 0:
            raise ValueError(f"a node lease must be > 0 s and its margin >= 0 s (got {lease}, {margin})")
        self.lease, self.margin = lease, margin
        self._on_expire = on_expire
        self._held: dict[Channel, _Held] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="hotspare-leases", daemon=True).start()

    def add(self, node: str, channel: Channel) -> None:
        with self._lock:
            self._held[channel] = _Held(node, channel, time.monotonic())

    def renew(self, channel: Channel) -> bool:
        """A renewal arrived on ``channel``; False when that link holds no lease (any more)."""
        with self._lock:
            held = self._held.get(channel)
            if held is None:
                return False
            held.last = time.monotonic()
            return True

    def release(self, channel: Channel) -> bool:
        """The link closed: drop its lease. False when it had already expired (and was reported)."""
        with self._lock:
            return self._held.pop(channel, None) is not None

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        tick = min(0.1, self.lease / 10)
        while not self._closed.wait(tick):
            now = time.monotonic()
            with self._lock:
                expired = [h for h in self._held.values() if overdue(h.last, now, self.lease, self.margin)]
                for h in expired:
                    del self._held[h.channel]
            for h in expired:
                self._on_expire(h.node, h.channel, now - h.last)
