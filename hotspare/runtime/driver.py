"""Carries out the worker's phase machine (runtime/phase.py): feeds it events, does its effects.

The training thread calls ``handle`` with what happened (a step failed, the loop reached its
top, the last step is done); the driver asks ``phase.transition`` what to do and does it
(rollback, teardown, report, await the next order, join, hand off), feeding back the events
those effects produce (the order taken, the join's outcome) until the machine is stepping
again, released, or stopped. The control channel's reader thread calls ``notify`` with the
two events that cannot wait for the training thread (``Aborted``: the thread may be blocked in
the very collective the abort frees; ``PauseAsked``); their only effect, aborting a group, is
thread-safe. Orders go from the reader thread onto the link's queue, taken here by ``AwaitOrder``.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from collections import deque
from typing import Any, Callable

from hotspare.errors import JobFailed, StateMismatch
from hotspare.runtime import phase as ph
from hotspare.runtime.failures import Collectives
from hotspare.runtime.link import AgentLink
from hotspare.runtime.membership import Membership


class WorkerDriver:
    def __init__(self, link: AgentLink, members: Membership, *, role: str,
                 rollback: Callable[[int], None], checkpoint: Callable[[], None]):
        self.link, self.members = link, members
        self._rollback, self._checkpoint = rollback, checkpoint
        self.state = ph.WorkerState(role=role)
        self.trace: list[tuple[str, str]] | None = None    # (event, phase after) when tracing (tests)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ events in
    def notify(self, event: ph.Event) -> None:
        """From the reader thread: ``Aborted`` or ``PauseAsked``."""
        for effect in self._apply(event):
            self._execute(effect)

    def handle(self, event: ph.Event) -> None:
        """On the training thread: run ``event`` and everything its effects lead to."""
        pending = deque([event])
        while pending:
            for effect in self._apply(pending.popleft()):
                produced = self._execute(effect)
                if produced is not None:
                    pending.append(produced)

    def await_order(self) -> None:
        """A worker's start: wait for the order that names its generation (or its release)."""
        self.handle(self._next_order())

    def _apply(self, event: ph.Event) -> list[ph.Effect]:
        with self._lock:
            self.state, effects = ph.transition(self.state, event)
            if self.trace is not None:
                self.trace.append((type(event).__name__, self.state.phase.value))
        return effects

    # ------------------------------------------------------------------ where things stand
    @property
    def phase(self) -> ph.WorkerPhase:
        return self.state.phase

    @property
    def recovering(self) -> bool:
        return self.state.failure is not None

    # ------------------------------------------------------------------ effects out
    def _execute(self, effect: ph.Effect) -> ph.Event | None:
        m = self.members
        if isinstance(effect, ph.AbortGroup):
            m.abort_upto(effect.upto)
        elif isinstance(effect, ph.Rollback):
            self._rollback(effect.step)
        elif isinstance(effect, ph.Teardown):
            m.teardown()
        elif isinstance(effect, ph.Report):
            self.link.send(effect.type, gen=m.generation, rank=m.rank, **effect.fields)
        elif isinstance(effect, ph.AwaitOrder):
            return self._next_order()
        elif isinstance(effect, ph.Checkpoint):
            self._checkpoint()
        elif isinstance(effect, ph.Join):
            return self._join(effect.msg)
        elif isinstance(effect, ph.HandOff):
            m.handoff(effect.msg)             # never returns: this worker's part is over
        elif isinstance(effect, ph.Stop):
            raise JobFailed(effect.reason)
        elif isinstance(effect, ph.ExitSpare):
            atexit._run_exitfuncs()           # what the script registered before init() still runs
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        else:                                 # pragma: no cover - the union is closed
            raise AssertionError(f"unknown effect {effect!r}")
        return None

    def _next_order(self) -> ph.Event:
        msg = self.link.next_order()
        if msg["type"] == "release":
            return ph.Released(str(msg.get("reason", "")))
        if msg["type"] == "checkpoint_now":
            return ph.CheckpointAsked()
        return ph.Order(msg)

    def _join(self, msg: dict[str, Any]) -> ph.Event:
        m = self.members
        try:
            m.join(msg)
        except Exception as e:
            # Everything a join does is hotspare's own communication (the group's rendezvous, the
            # state transfer): gloo reports a peer that died or stalled in it as a plain
            # RuntimeError raised from a wait() in hotspare's code, so that counts too.
            transport = type(e) is RuntimeError
            if isinstance(e, StateMismatch) or not (transport or Collectives().is_peer_failure(e, m.broken)):
                raise
            return ph.JoinFailed(str(e).splitlines()[0] if str(e) else type(e).__name__, m.progress.committed)
        return ph.Joined(m.generation, m.rank, m.world_size)
