"""The coordinator's side of fault injection (a plug-in: ``Coordinator(plugins=[CoordinatorFaults(...)])``).

``Arming`` gives each fault to every node agent, now and as they connect; the agent whose node
runs the rank it names fires it, and the others drop their copy. ``CoordinatorFaults`` attaches
to the coordinator's seam (``Coordinator.listen`` and ``Coordinator.command``): it arms the
command line's faults, logs each fault that fired and tells the ledger when (a failure's
downtime and detection latency run from then), and answers the operator's ``inject`` command.
"""
from __future__ import annotations

import itertools
import sys
from typing import Iterable

from hotspare.coordinator import events as ev
from hotspare.coordinator.nodes import Nodes
from hotspare.errors import ConfigError
from hotspare.protocol.messages import Message, make
from hotspare.testing.faults.grammar import Fault, parse


class Arming:
    """The faults given to the node agents and not fired yet (coordinator thread only)."""

    def __init__(self, nodes: Nodes):
        self.nodes = nodes
        self._ids = itertools.count()
        self.armed: dict[int, tuple[str, bool]] = {}     # id -> (spec, running)

    def arm(self, spec: str, running: bool) -> int:
        """Give a fault to every agent, now and as they connect (``node_joined``)."""
        ident = next(self._ids)
        self.armed[ident] = (spec, running)
        for node in self.nodes.live_nodes():
            self.nodes.tell(node.name, make("arm", id=ident, spec=spec, running=running))
        return ident

    def node_joined(self, name: str) -> None:
        for ident, (spec, running) in self.armed.items():
            self.nodes.tell(name, make("arm", id=ident, spec=spec, running=running))

    def fired(self, ident: int, worker: str) -> None:
        """A fault fired on ``worker``'s node: the other nodes drop their copy."""
        self.armed.pop(ident, None)
        here = self.nodes.workers[worker].node if worker in self.nodes.workers else None
        for node in self.nodes.live_nodes():
            if node.name != here:
                self.nodes.tell(node.name, make("disarm", id=ident))


class CoordinatorFaults:
    """``faults``: the command line's (``--inject``), armed on every node from the start."""

    def __init__(self, faults: Iterable[Fault] = ()):
        self.faults = list(faults)
        self.coord = None
        self.arming: Arming | None = None

    def install(self, coord) -> None:
        """``coord``: the ``hotspare.coordinator.Coordinator`` this plug-in serves."""
        self.coord, self.arming = coord, Arming(coord.nodes)
        coord.listen(ev.NodeConnected, self._node_connected)
        coord.listen(ev.FaultInjected, self._injected)
        coord.command("inject", self._inject)
        for fault in self.faults:
            self.arming.arm(str(fault), running=False)

    def _node_connected(self, e: ev.NodeConnected) -> None:
        node = self.coord.nodes.nodes.get(e.node)
        if node is not None and node.channel is e.channel and not node.lost:    # accepted
            self.arming.node_joined(e.node)

    def _injected(self, e: ev.FaultInjected) -> None:
        self.arming.fired(e.ident, e.worker)
        try:
            fault = parse(e.fault, running=True)
        except ConfigError as err:
            print(f"hotspare: an agent reported an unreadable fault: {err}", file=sys.stderr)
            return
        self.coord.ledger.fault_injected(e.worker, e.t)
        how = {"device": "its device's simulated telemetry", "worker": "the worker itself"}.get(
            fault.target) or (fault.signal.name if fault.signal else f"exit with status {fault.code}")
        pid = self.coord.nodes.workers[e.worker].pid
        self.coord.log(f"FAULT   injected {fault} -> {how} to worker {e.worker} (pid {pid})")

    def _inject(self, msg: Message, origin: str) -> Message:
        """``hotspare inject SPEC``: arm a fault in the running job."""
        log, view = self.coord.log, self.coord.view
        try:
            fault = parse(msg["spec"], world_size=view.world_size, running=True)
        except ConfigError as e:
            log(f"OPERATOR refused inject {msg['spec'][:100]!r} from {origin}: {str(e).splitlines()[0]}")
            return make("control_reply", ok=False, message=str(e))
        if fault.target == "device" and not self.coord.nodes.device_faults():
            return make("control_reply", ok=False, message=f"{fault.kind} faults need simulated telemetry "
                        "(hotspare run --telemetry simulated)")
        self.arming.arm(str(fault), running=True)
        when = f"at step {fault.step}" if fault.step is not None else "at its next step"
        log(f"OPERATOR inject {fault} from {origin}: fires on rank {fault.rank} {when}")
        return make("control_reply", ok=True, message=f"{fault} armed: fires on rank {fault.rank} {when}")
