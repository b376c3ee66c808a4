"""The node agent's side of fault injection (a plug-in: ``NodeAgent(faults=AgentFaults(...))``).

Triggers are the workers' own messages, acted on by the agent the moment they arrive: while a
fault is armed the workers are told to ``watch`` (report each step's start), and each trigger
(``step``, ``joining``, ``transfer``) carries a ``wait`` number; the worker goes on only once the
agent answers ``go`` with it, so a fault lands exactly there (a SIGKILL at step 17 kills the rank
in step 17), in the middle of the step or the recovery phase, as a real one would. A fault fires
once: the replacement that later runs the same step is left alone.
"""
from __future__ import annotations

import sys
import threading
from typing import Callable

from hotspare.protocol.channel import Channel
from hotspare.protocol.messages import Message, make
from hotspare.testing.faults.grammar import PROCESS_FAULTS, Fault, parse



class Injector:
    """Decides, on each heartbeat, whether a fault fires now."""

    def __init__(self, faults: list[Fault]):
        self.faults = faults
        self.max_step = -1            # the newest step any rank has started
        self._lock = threading.Lock()

    def add(self, fault: Fault) -> None:
        """A fault given to the running job (``hotspare inject``)."""
        with self._lock:
            self.faults.append(fault)

    def pending(self) -> bool:
        """Some fault has not fired yet: the agent must see every step begin."""
        with self._lock:
            return any(not f.fired for f in self.faults)

    def at_step(self, rank: int, step: int) -> Fault | None:
        self.max_step = max(self.max_step, step)
        return self._take(lambda f: f.phase is None and f.rank == rank
                          and (f.step == step or (f.step is None and (f.kind not in PROCESS_FAULTS or f.now))))

    def at_phase(self, rank: int, phase: str, gen: int) -> Fault | None:
        return self._take(lambda f: f.phase == phase and f.rank == rank and self.max_step >= f.after
                          and (gen == f.gen if f.gen is not None else gen >= 2))

    def _take(self, match) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if not f.fired and match(f):
                    f.fired = True
                    return f
        return None


class AgentFaults:
    """Fault injection on one node agent. ``device_fault(device, fault)`` carries out injected
    device faults (simulated telemetry); without it, device faults are refused by the coordinator."""

    def __init__(self, device_fault: Callable[[str, Fault], None] | None = None):
        self.device_fault = device_fault
        self.injector = Injector([])
        self._armed: dict[int, Fault] = {}       # arm id -> fault, to disarm it
        self._watching = False
        self._agent = None

    # ------------------------------------------------------------------ the seam the agent calls
    def attach(self, agent) -> None:
        """``agent``: the ``hotspare.agent.NodeAgent`` this plug-in serves."""
        self._agent = agent

    @property
    def device_faults(self) -> bool:
        return self.device_fault is not None

    def commands(self) -> dict[str, Callable[[Message], None]]:
        """The agent commands this plug-in adds (from the coordinator's ``CoordinatorFaults``)."""
        return {"arm": self._arm, "disarm": self._disarm}

    def connected(self, worker: str, ch: Channel) -> None:
        """A worker's control channel is bound (under the agent's ``channel_lock``): before its
        generation arrives, in order on this channel, it learns whether to watch its steps."""
        if self._watching:
            ch.send(make("watch", steps=True))

    def on_message(self, worker: str, msg: Message, ch: Channel, now: float) -> None:
        """A worker's message, before it is relayed: fire the fault its trigger matches, then
        let the worker go on if it waits."""
        kind = msg["type"]
        fault = None
        if kind == "step":
            fault = self.injector.at_step(msg["rank"], msg["step"])
        elif kind in ("joining", "transfer"):
            phase = "join" if kind == "joining" else "transfer"
            fault = self.injector.at_phase(msg["rank"], phase, msg["gen"])
        if fault is not None:
            self._inject(worker, fault, now)
            self.watch_steps()
        if isinstance(msg.get("wait"), int):     # a trigger: the worker waits for this
            try:
                ch.send(make("go", wait=msg["wait"]))
            except OSError:
                pass                 # killed just now by the fault

    # ------------------------------------------------------------------ arming and firing
    def _arm(self, msg: Message) -> None:
        fault = parse(msg["spec"], running=msg["running"])
        self._armed[msg["id"]] = fault
        self.injector.add(fault)
        self.watch_steps()

    def _disarm(self, msg: Message) -> None:
        fault = self._armed.get(msg["id"])
        if fault is not None:
            fault.fired = True
            self.watch_steps()

    def watch_steps(self) -> None:
        """Workers report each step's start only while a fault waits to fire (a step boundary is
        its trigger); otherwise the per-step message is skipped: each one wakes the agent (an
        A/B of this message alone measured ~2% of a 100 ms step on a 2-core machine). Called
        when faults are armed or fire."""
        agent = self._agent
        with agent.channel_lock:                 # decide and tell under one lock: threads race here
            on = self.injector.pending()
            if on != self._watching:
                self._watching = on
                for w in list(agent.workers):
                    agent.send(w, make("watch", steps=on))

    def _inject(self, worker: str, fault: Fault, now: float) -> None:
        agent = self._agent
        wp = agent.workers[worker]
        if fault.target == "device":
            if self.device_fault is None or wp.device is None:
                print(f"hotspare agent: cannot inject {fault}: no simulated telemetry for this worker's "
                      "device", file=sys.stderr, flush=True)
                return
            self.device_fault(wp.device, fault)
        elif fault.target == "worker":
            agent.send(worker, make("fault", kind=fault.kind, params=dict(fault.params)))
        elif fault.kind == "exit":
            # The worker's control thread calls os._exit(code): an abrupt exit with that status.
            agent.send(worker, make("exit_now", code=fault.code))
        else:
            agent.kill(worker, fault.signal, group=False)
        ident = next((i for i, f in self._armed.items() if f is fault), -1)
        agent.report("injected", worker=worker, fault=str(fault), id=ident, t=now)
