"""The coordinator's side of its node agents: their links, and what it knows of their workers.

Each node agent connects to the ``NodeEndpoint`` and says ``agent_hello``, proven with the job
secret (``hotspare.protocol.auth``); from then on its messages become events on the
coordinator's queue, in the order the agent sent them. A node speaks only for the workers the
coordinator placed on it: a message about any other worker is refused and logged, as is a
relayed message that is not a worker's or whose time is far from the coordinator's clock. ``Nodes``
is the coordinator's picture of the fleet, kept by the coordinator's own thread from those
events: which workers exist, where, on which device, their pid and last step. It also carries
the coordinator's decisions down as commands: placement (which node and device a new worker
gets) is decided here, the agent only carries it out. Nothing here blocks on an agent.
"""
from __future__ import annotations

import math
import queue
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from hotspare.coordinator import events as ev
from hotspare.errors import ProtocolError
from hotspare.protocol import auth
from hotspare.protocol.channel import Channel
from hotspare.protocol.listen import Listener, bound_server
from hotspare.protocol.messages import MAX_LINE, Message, make

if TYPE_CHECKING:
    from hotspare.coordinator.lease import Leases

MAX_SKEW_S = 300.0         # an agent's event time may be this far from the coordinator's clock


@dataclass
class Worker:
    """What the coordinator knows of one worker process."""
    worker: str
    node: str
    role: str
    rank: int | None
    device: str | None
    pid: int | None = None               # once the agent says it started
    last_step: int | None = None         # the step it runs (from its messages)
    exit_code: int | None = None
    stopped: bool = False                # SIGSTOPped, as its agent sees it


@dataclass
class Node:
    name: str
    channel: Channel | None              # None: restored by a restarted coordinator, awaiting its agent
    devices: list[str]
    device_faults: bool
    pid: int
    lost: bool = False
    lost_at: float | None = None     # lost while the job ran (not in its shutdown)
    workers: set[str] = field(default_factory=set)
    # re-registered after a restart: its workers then running that its agent no longer ran;
    # their exits come in what the agent replays (``Coordinator._node_resumed`` settles the rest)
    missing: set[str] = field(default_factory=set)


def worker_number(worker: str) -> int:
    """The number of worker ``w7`` (or, in a job of the coordinator service, ``j2.w7``)."""
    return int(worker.rpartition("w")[2])


def refuse(ch: Channel, command: str, message: str) -> None:
    """Tell the other end why (if it still listens), then hang up."""
    try:
        ch.send(make("refused", command=command, message=message))
    except OSError:
        pass
    ch.close()


class NodeEndpoint:
    """The TCP listener node agents connect to. Each link is read by its own thread, which
    decodes its messages into typed events (``coordinator.events``) on ``events``.
    ``owner(worker)``: the node the coordinator placed ``worker`` on (None: no such worker)."""

    def __init__(self, events: "queue.Queue", secret: bytes, owner: Callable[[str], str | None],
                 host: str = "127.0.0.1", port: int = 0, welcome: Callable[[Message], Message] | None = None,
                 leases: "Leases | None" = None, route: Callable[[str], "queue.Queue"] | None = None,
                 clients: Callable[[Channel, Message], None] | None = None, listen: bool = True):
        """``welcome(hello)``: the first message to each agent that connects (remote agents learn the
        job from it); ``leases``: the nodes here hold leases (``hotspare.coordinator.lease``) they
        renew, and a node whose lease expires is lost as one whose link closed. A coordinator
        service of many jobs (``hotspare.service``) gives ``route(node)``: the queue of the job
        that node's events go to (else all go to ``events``), and ``clients(channel, request)``,
        which serves the authenticated requests of `hotspare submit`, `status` and `cancel` on
        the same address. ``listen=False``: no TCP listener at all, only agents of this
        process (``attach``): the launcher's own, with no remote ones."""
        self.events = events
        self._key = auth.node_key(secret)
        self._client_key = auth.client_token(secret) if clients is not None else None
        self._owner = owner
        self._welcome, self.leases = welcome, leases
        self._route = route or (lambda node: events)
        self._clients = clients
        self.address, self._listener = "in-process", None
        if listen:
            server = bound_server(host, port)
            self.address = f"{host}:{server.getsockname()[1]}"
            # A relay wraps a worker's line (at most MAX_LINE on the agent's worker port): room for both.
            self._listener = Listener(server, self._handshake, self._serve, "hotspare-node-endpoint",
                                      max_line=2 * MAX_LINE)

    def attach(self, channel: Any, hello: Message) -> None:
        """Serve a node agent of this process over ``channel`` (protocol/local.py), as if it had
        connected and said ``hello``: nothing to authenticate, the rest as for any node."""
        import threading
        threading.Thread(target=self._serve, args=(channel, hello), daemon=True,
                         name=f"hotspare-node-endpoint-{hello['node']}").start()

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self.leases is not None:
            self.leases.close()

    def _handshake(self, ch: Channel) -> Message:
        try:
            if self._clients is None:
                return auth.accept(ch, auth.NODE, lambda node: self._key)
            return auth.accept(ch, (auth.NODE, auth.CLIENT),
                               lambda role, who: self._key if role == auth.NODE else self._client_key)
        except ProtocolError as e:
            refuse(ch, "connect", str(e))
            raise

    def _serve(self, ch: Channel, hello: Message) -> None:
        if hello["type"] == "request":
            self._clients(ch, hello)
            return
        node = hello["node"]
        if self._welcome is not None:
            try:
                ch.send(self._welcome(hello))
            except OSError:
                return
        if self.leases is not None:
            self.leases.add(node, ch)
        self._route(node).put(ev.NodeConnected(node, hello, ch, time.time()))
        while True:
            try:
                msg = ch.recv()
            except ProtocolError as e:
                # One bad line is refused; the link and this node's workers go on.
                _say(f"ignoring a bad message from node {node}: {e}")
                continue
            except OSError:
                msg = None
            if msg is None:       # the payload tells this link from a later one of the same name
                ch.close()        # the peer is gone: whoever holds the channel (the service's pool) sees it closed
                if self.leases is None or self.leases.release(ch):     # else: lost already, by its lease
                    self._route(node).put(ev.NodeLost(node, ch, time.time()))
                return
            if msg["type"] == "renew" and self.leases is not None:
                if self.leases.renew(ch):
                    try:
                        ch.send(make("renewed", seq=msg["seq"]))
                    except OSError:
                        pass
                continue
            try:
                self._event(node, msg, hello["devices"])
            except ProtocolError as e:
                _say(f"refusing {msg['type']!r} from node {node} ({auth.peer(ch)}): {e}")

    def _event(self, node: str, msg: Message, devices: list[str]) -> None:
        """Queue the event ``msg`` stands for, or raise ProtocolError: not an agent's message,
        about a worker of another node, readings of a device not among the node's own
        (``devices``, from its hello), or not a worker's message inside a relay."""
        event = ev.decode(node, msg, _event_time, time.time())
        if isinstance(event, ev.WORKER_EVENTS) and self._owner(event.worker) != node:
            raise ProtocolError(f"worker {event.worker[:64]!r} is not one this node runs")
        if isinstance(event, ev.Readings):
            alien = sorted({r.device for r in event.readings} - set(devices))
            if alien:
                raise ProtocolError(f"readings of {', '.join(d[:64] for d in alien[:5])}: not this node's devices")
        self._route(node).put(event)


def _event_time(t: float) -> float:
    """An agent's time stamp, if it is sane: never later than now (a time far ahead would
    keep hang detection from ever firing)."""
    now = time.time()
    if not math.isfinite(t) or abs(t - now) > MAX_SKEW_S:
        raise ProtocolError(f"event time {t!r} is more than {MAX_SKEW_S:.0f} s from the coordinator's clock")
    return min(t, now)


def _say(line: str) -> None:
    print(f"hotspare: {line}", file=sys.stderr, flush=True)


class Nodes:
    """The coordinator's view of its node agents and their workers (coordinator thread only)."""

    def __init__(self, usable: Callable[[str], bool] = lambda d: True, job: str = ""):
        """``job``: the job these nodes run, as its agents name it when they re-register with a
        restarted coordinator (``hotspare.service``)."""
        self.usable, self.job = usable, job
        self.nodes: dict[str, Node] = {}
        self.workers: dict[str, Worker] = {}
        self.next_id = 0                                 # the next worker is w<next_id>
        self.orders: dict[str, Message] = {}             # worker -> the last generation/handoff order it got
        self._held: list[tuple[Node, Message]] | None = None   # commands held back (``hold``)
        self.ending = False                              # shutdown asked: links closing now are no loss

    # ------------------------------------------------------------------ links
    def owner(self, worker: str) -> str | None:
        """The node ``worker`` was placed on (safe from any thread: one dict look-up)."""
        info = self.workers.get(worker)
        return info.node if info is not None else None

    def add(self, hello: Message, channel: Channel) -> Node:
        name = hello["node"]
        known = self.nodes.get(name)
        if known is not None and not known.lost and known.channel is None:
            return self._reattach(known, hello, channel)
        if name in self.nodes and not self.nodes[name].lost:
            raise ProtocolError(f"a node named {name!r} is already connected")
        if name in self.nodes:     # its old workers are gone or fenced: a new link must not speak for them
            raise ProtocolError(f"node {name!r} was declared lost; a host that comes back joins as a new "
                                "node (hotspare agent --name ANOTHER)")
        node = Node(name, channel, [str(d) for d in hello["devices"]], hello["device_faults"], hello["pid"])
        self.nodes[name] = node
        return node

    def _reattach(self, node: Node, hello: Message, channel: Channel) -> Node:
        """The agent of a node this coordinator knew before it restarted re-registers: it must
        speak for the same job and hold no worker this coordinator never placed on it."""
        if hello.get("job") != self.job:
            raise ProtocolError(f"node {node.name!r} re-registers for job {str(hello.get('job'))[:64]!r}, "
                                f"not {self.job!r}")
        alive = hello.get("alive")
        if (not isinstance(alive, list) or not all(isinstance(w, str) for w in alive)
                or not set(alive) <= node.workers):
            raise ProtocolError(f"node {node.name!r} re-registers with workers this coordinator did not place there")
        node.channel, node.pid = channel, hello["pid"]
        node.missing = {w for w in node.workers if self.workers[w].exit_code is None} - set(alive)
        return node

    def detached(self) -> list[str]:
        """Live nodes whose agents have not re-registered since this coordinator restarted."""
        return [n.name for n in self.nodes.values() if not n.lost and n.channel is None]

    def lose(self, name: str, channel: Channel | None = None) -> list[str]:
        """The link ``channel`` to ``name`` closed (any link when None): its live workers are
        lost with it (returned). A refused second link of the same name loses nothing."""
        node = self.nodes.get(name)
        if node is None or node.lost or (channel is not None and channel is not node.channel):
            return []
        node.lost = True
        if not self.ending:
            node.lost_at = time.time()
        return [w for w in sorted(node.workers) if self.workers[w].exit_code is None]

    def tell(self, name: str, msg: Message) -> bool:
        """Send a command to the agent of node ``name``; False when its link is gone."""
        node = self.nodes.get(name)
        return node is not None and self._tell(node, msg)

    def hold(self) -> None:
        """Hold every command back until ``flush``: a coordinator that persists its state writes
        it first, so that no agent acts on a decision the state does not hold yet."""
        self._held = []

    def flush(self) -> None:
        held, self._held = self._held or [], None
        for node, msg in held:
            self._tell(node, msg)

    def _tell(self, node: Node, msg: Message) -> bool:
        if self._held is not None:
            self._held.append((node, msg))
            return not node.lost
        if node.lost or node.channel is None:
            return False
        try:
            node.channel.send(msg)
            return True
        except OSError:
            return False

    def live_nodes(self) -> list[Node]:
        return [n for n in self.nodes.values() if not n.lost]

    # ------------------------------------------------------------------ placement
    def free_devices(self) -> list[str]:
        """Device slots no live worker holds and ``usable`` accepts, node by node."""
        held = {w.device for w in self.workers.values() if w.exit_code is None}
        return [d for n in self.live_nodes() for d in n.devices if d not in held and self.usable(d)]

    def _place(self) -> tuple[Node, str | None] | None:
        free = self.free_devices()
        for node in self.live_nodes():
            if not node.devices:       # no device slots: processes only, the least loaded node
                continue
            device = next((d for d in node.devices if d in free), None)
            if device is not None:
                return node, device
        bare = [n for n in self.live_nodes() if not n.devices]
        if bare:
            return min(bare, key=lambda n: len(self.alive_on(n))), None
        return None

    def spawn(self, role: str, rank: int | None = None) -> str | None:
        """Place and start a worker; its id, or None when no usable device slot is free."""
        where = self._place()
        if where is None:
            return None
        node, device = where
        worker = f"{self.job}.w{self.next_id}" if self.job else f"w{self.next_id}"
        self.next_id += 1
        self.workers[worker] = Worker(worker, node.name, role, rank, device)
        node.workers.add(worker)
        self._tell(node, make("spawn", worker=worker, role=role, rank=rank, device=device))
        return worker

    # ------------------------------------------------------------------ workers
    def alive(self) -> list[str]:
        return [w for w, info in self.workers.items() if info.exit_code is None]

    def alive_on(self, node: Node) -> list[str]:
        return [w for w in node.workers if self.workers[w].exit_code is None]

    def send(self, worker: str, msg: Message) -> bool:
        info = self.workers.get(worker)
        if msg["type"] in ("generation", "handoff"):
            self.orders[worker] = msg
        return info is not None and self._tell(self.nodes[info.node], make("deliver", worker=worker, msg=msg))

    def kill(self, worker: str, sig: signal.Signals = signal.SIGKILL, group: bool = True) -> float:
        info = self.workers[worker]
        self._tell(self.nodes[info.node], make("kill", worker=worker, signal=int(sig), group=group))
        return time.time()

    def device_faults(self) -> bool:
        return any(n.device_faults for n in self.live_nodes())

    def observe(self, event: ev.Event) -> Worker | None:
        """Keep the picture current from an agent event; the worker it is about, if known."""
        info = self.workers.get(getattr(event, "worker", None))
        if info is None:
            return None
        if isinstance(event, ev.WorkerStarted):
            info.pid = event.pid
        elif isinstance(event, ev.WorkerExited):
            info.exit_code = event.code
        elif isinstance(event, ev.WorkerStopped):
            info.stopped = event.stopped
        elif isinstance(event, ev.WorkerSaid):
            msg = event.msg
            if msg["type"] == "step":          # only while faults are armed (hotspare.testing.faults)
                info.rank, info.last_step = msg["rank"], msg["step"]
            elif msg["type"] == "commit":      # the next step begins right after a commit
                info.rank, info.last_step = msg["rank"], msg["step"] + 1
            elif msg["type"] == "joined" and isinstance(msg.get("committed"), int) and not msg.get("pending"):
                info.last_step = msg["committed"] + 1      # the step it runs first (once its state is in)
        return info

    def describe(self) -> dict[str, Any]:
        """For the report: each node's device slots, whether (and when) it was lost while the job
        ran, and every worker it ran."""
        return {n.name: {"devices": n.devices, "lost": n.lost_at is not None, "lost_at": n.lost_at, "workers": [
            {"worker": w, "role": self.workers[w].role, "rank": self.workers[w].rank,
             "device": self.workers[w].device, "exit_code": self.workers[w].exit_code}
            for w in sorted(n.workers, key=worker_number)]} for n in self.nodes.values()}

    def shutdown(self, grace: float) -> None:
        """Ask every agent to end its workers (SIGKILL after ``grace`` seconds) and close."""
        self.ending = True
        for node in self.live_nodes():
            self._tell(node, make("shutdown", grace=grace))
