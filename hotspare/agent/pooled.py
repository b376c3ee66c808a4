"""A node agent in the pool of the coordinator service (``hotspare coordinator``).

The agent registers with no job; the service places jobs on it (``assign``: the script, its
arguments, the worker contract and the device slots this job may use), and for each one it
runs a ``NodeAgent`` over the same link until the job's coordinator shuts its part down; then
it says ``released`` and waits for the next job. One job at a time: an ``assign`` while a job
still runs here is refused (the service places only a host whose agent said ``released``,
``hotspare.service.hostlife``), and a ``shutdown`` for the job it already left is answered
with ``released`` again.

The link outlives a crash of the service (``ServiceLink``). When it closes, the agent keeps its
workers training and reconnects; meanwhile what it would send waits in a bounded buffer, in
order. On re-registering it names its job and its live workers, replays the buffer, and says
``resumed``; a service that does not resume that job gets its workers ended. Fencing still
holds: the lease of the lost link runs on, and only the service's *host refusing* a connection
(nothing listens there: no coordinator runs that could declare this node lost) extends it. A
host cut off from the network gets no answer at all, so its lease runs out and it kills its
workers before a restarted service, which waits a lease and a margin for the agents to come
back, can give their ranks to spares elsewhere.
"""
from __future__ import annotations

import collections
import hmac
import os
import queue
import secrets
import sys
import threading
import time
from typing import Callable

from hotspare.agent.agent import NodeAgent
from hotspare.agent.lease import AgentLease
from hotspare.errors import ProtocolError
from hotspare.protocol import auth
from hotspare.protocol.channel import Channel
from hotspare.protocol.lease import welcome_proof
from hotspare.protocol.messages import Message, make

EXIT_FENCED = 3
# what a worker says before it waits for an order: said again to a restarted service, in case the
# crash lost it on the way (the coordinator takes each of them twice alike)
WAITING = frozenset({"ready", "failed", "paused", "done"})
BUFFER = 100_000          # messages kept while the service is away (the oldest go first beyond)
RETRY_S = 0.25            # between reconnection attempts
CONNECT_TIMEOUT_S = 1.0   # an attempt that gets no answer in this long is a host that does not answer
AWAY_MAX_S = 600.0        # the service refused connections this long: end the workers, leave


class JobUplink:
    """What one job's ``NodeAgent`` sees of the link: its commands, in order; sends go to the
    service link (buffered while it is away); closing it ends this node's part of the job."""

    def __init__(self, job: str, link: "ServiceLink"):
        self.job, self._link = job, link
        self.commands: "queue.Queue[Message | None]" = queue.Queue()
        self.closed = threading.Event()

    def send(self, msg: Message) -> None:
        self._link.send(msg)

    def recv(self) -> Message | None:
        return self.commands.get()

    def close(self) -> None:
        self.closed.set()
        self.commands.put(None)


class ServiceLink:
    def __init__(self, address: str, secret: bytes, node: str, devices: list[str], spare: bool,
                 say: Callable[[str], None], device_faults: bool = False):
        """``device_faults``: this host carries out injected device faults (``NodeTelemetry.injectable``)."""
        self.address, self._secret, self.node, self.devices, self.spare = address, secret, node, devices, spare
        self.say, self.device_faults = say, device_faults
        self.job: JobUplink | None = None
        self.last_job = ""                 # the job this node ran last, once its part of it ended
        self.alive: Callable[[], list[str]] = lambda: []
        self.assignments: "queue.Queue[Message]" = queue.Queue()
        self.fenced = threading.Event()
        self._channel: Channel | None = None
        self._lease: AgentLease | None = None
        self._buffer: collections.deque[Message] = collections.deque(maxlen=BUFFER)
        self._waiting: dict[str, Message] = {}     # worker -> its relayed WAITING message, if its last
        self._lock = threading.Lock()
        self._away_since: float | None = None
        self.on_fence: Callable[[str], None] = lambda why: None

    # ------------------------------------------------------------------ registering
    def register(self, timeout: float = auth.CHALLENGE_WAIT_S) -> Message:
        """Connect, prove the secret, name the job this node works for (if any) and its live
        workers; check the service's proof; the ``registered`` answer. Raises OSError (no
        connection) or ProtocolError (refused, or an impostor)."""
        nonce = secrets.token_hex(16)
        hello_at = time.monotonic()        # the lease counts from before the hello went out
        job = self.job.job if self.job is not None else ""
        ch = auth.connect(self.address, auth.NODE, auth.node_key(self._secret), timeout=timeout, node=self.node,
                          pid=os.getpid(), devices=self.devices, device_faults=self.device_faults, nonce=nonce,
                          spare=self.spare, job=job, alive=self.alive() if job else [])
        try:
            ch.sock.settimeout(auth.CHALLENGE_WAIT_S)
            reply = ch.recv(any_version=True)     # a refusal of a service of another version, too
            ch.sock.settimeout(None)
        except BaseException:
            ch.close()
            raise
        if reply is None or reply["type"] != "registered":
            ch.close()
            why = reply["message"] if reply is not None and reply["type"] == "refused" else "it closed the link"
            raise ProtocolError(f"the coordinator at {self.address} did not register node {self.node}: {why}")
        if not hmac.compare_digest(welcome_proof(self._secret, self.node, nonce), reply["proof"]):
            ch.close()
            raise ProtocolError(f"{self.address} could not prove it holds the secret; not working for it")
        self.attach(ch, reply, hello_at)
        return reply

    def attach(self, ch: Channel, reply: Message, hello_at: float) -> None:
        """Work over ``ch``, whose registration ``reply`` (proven) came in answer to a hello sent at
        ``hello_at``."""
        lease = AgentLease(float(reply["lease"]), send=ch.send, fence=self._lease_ran_out, granted_at=hello_at)
        with self._lock:
            old, self._lease = self._lease, lease
            if old is not None:
                old.stop()
            resumed = self.job is not None and reply["job"] == self.job.job
            # What waited goes first, in order; then the word that it is all there.
            replayed = len(self._buffer)
            while self._buffer:
                ch.send(self._buffer.popleft())
            if resumed:     # what was in flight when the service died is lost: say again what each waits on
                for msg in self._waiting.values():
                    ch.send(msg)
                ch.send(make("resumed", job=self.job.job, alive=self.alive()))
            self._channel, self._away_since = ch, None
        lease.start()
        if replayed:
            self.say(f"replayed {replayed} message(s) kept while the coordinator was away")
        threading.Thread(target=self._read, args=(ch, lease), name="agent-service-link", daemon=True).start()
        if not resumed:
            self._waiting.clear()
        if self.job is not None and not resumed:
            self.on_fence(f"the coordinator did not resume job {self.job.job} on this node")

    # ------------------------------------------------------------------ the link
    def send(self, msg: Message) -> None:
        with self._lock:
            if msg["type"] == "relay":
                if msg["msg"]["type"] in WAITING:
                    self._waiting[msg["worker"]] = msg
                else:
                    self._waiting.pop(msg["worker"], None)
            elif msg["type"] == "exited":
                self._waiting.pop(msg["worker"], None)
            if self._channel is not None:
                try:
                    self._channel.send(msg)
                    return
                except OSError:
                    pass
            if msg["type"] != "renew":
                self._buffer.append(msg)

    def _read(self, ch: Channel, lease: AgentLease) -> None:
        while True:
            try:
                msg = ch.recv()
            except ProtocolError as e:
                self.say(f"ignoring a bad message from the coordinator: {e}")
                continue
            except OSError:
                msg = None
            if msg is None:
                break
            kind = msg["type"]
            if kind == "renewed":
                lease.renewed(msg)
            elif kind == "refused":
                self.say(f"refused by the coordinator: {msg['message']}")
                if self.job is not None:
                    self.on_fence(f"the coordinator refused this node: {msg['message']}")
            elif kind == "assign":
                if self.job is not None:      # the service places only a host that released its last job
                    self.say(f"refusing job {str(msg['job'])[:64]}: job {self.job.job} still runs here")
                    self.send(make("refused", command="assign", message=f"job {self.job.job} still runs on "
                                   f"{self.node}; it takes the next job once it said released"))
                    continue
                self.job = JobUplink(msg["job"], self)
                self.assignments.put(msg)
            elif self.job is not None:
                self.job.commands.put(msg)
            elif kind == "shutdown" and self.last_job:
                # the service asks again for a job this node already left: say so again (the word may
                # have crossed the job's end), so the host goes back to the pool
                self.send(make("released", job=self.last_job))
            else:
                self.say(f"ignoring {kind!r}: no job runs on this node")
        with self._lock:
            if self._channel is not ch:
                return
            self._channel, self._away_since = None, time.monotonic()
        ch.close()
        if not self.fenced.is_set():
            self.say("the coordinator's link closed; training goes on, reconnecting")
            threading.Thread(target=self._reconnect, args=(lease,), name="agent-reconnect", daemon=True).start()

    def _reconnect(self, lease: AgentLease) -> None:
        while not self.fenced.is_set():
            tried = time.monotonic()
            try:
                self.register(timeout=CONNECT_TIMEOUT_S)
                self.say(f"registered again with {self.address}" + (f", resuming job {self.job.job}"
                                                                      if self.job is not None else ""))
                return
            except ConnectionRefusedError:
                lease.extend(tried)       # its host answered: no coordinator runs there now
            except (OSError, ProtocolError) as e:
                if isinstance(e, ProtocolError):
                    self.say(f"not registered: {e}")
            if self._away_since is not None and time.monotonic() - self._away_since > AWAY_MAX_S:
                self.on_fence(f"the coordinator did not come back within {AWAY_MAX_S:.0f} s")
                return
            time.sleep(RETRY_S)

    def end_job(self) -> None:
        """This node's part of the current job is over: back to the pool."""
        with self._lock:
            if self.job is not None:
                self.last_job = self.job.job
            self.alive, self.job = (lambda: []), None
            self._waiting.clear()

    def _lease_ran_out(self, silent: float) -> None:
        if self.job is not None:
            self.on_fence(f"lease ran out ({silent:.1f} s since the last answered renewal was sent)")


def serve_pool(link: ServiceLink, cmd_python: str, base_env: dict[str, str], spawn: str,
               worker_env: Callable[[Message], dict[str, str]], telemetry=None) -> int:
    """Work for the service at ``link``: each assigned job in turn, until fenced (EXIT_FENCED).
    ``telemetry``: this host's (``hotspare.agent.telemetry.NodeTelemetry``), polled for each job
    as often as its ``assign`` says; it also gives each job's agent its fault plug-in, if allowed."""
    holder: list[NodeAgent] = []
    fence_reason: list[str] = []

    def fence(why: str) -> None:
        if link.fenced.is_set():
            return
        link.fenced.set()
        fence_reason.append(why)
        agent = holder[-1] if holder else None
        count = len(agent.alive()) if agent is not None else 0
        link.say(f"FENCE   {why}: killing this node's {count} worker(s) and leaving")
        if agent is not None:
            agent.shutdown(grace=0.0)
        link.assignments.put(make("released", job=""))        # wakes the loop below

    link.on_fence = fence
    while not link.fenced.is_set():
        msg = link.assignments.get()
        if link.fenced.is_set():
            break
        job = link.job
        if job is None or job.job != msg["job"]:
            continue
        env = worker_env(msg)
        agent = NodeAgent([cmd_python, msg["script"], *msg["args"]], env, link.address, link._secret,
                          node=link.node, devices=list(msg["devices"]), spawn=spawn, uplink=job,  # type: ignore[arg-type]
                          faults=telemetry.job_faults() if telemetry is not None else None)
        holder.append(agent)
        link.alive = agent.alive
        link.say(f"job {job.job}: {len(msg['devices'])} device slot(s), {msg['script']}")
        if telemetry is not None:
            telemetry.start(agent, msg.get("telemetry_period"))
        agent.wait_closed()
        if telemetry is not None:
            telemetry.stop()
        if link.fenced.is_set():
            break
        link.end_job()
        link.send(make("released", job=job.job))
        link.say(f"job {job.job}: this node's part ended; waiting for the next job")
    return EXIT_FENCED


def say_for(node: str) -> Callable[[str], None]:
    def say(line: str) -> None:
        print(f"hotspare agent {node}: {line}", file=sys.stderr, flush=True)
    return say
