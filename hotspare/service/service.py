"""The coordinator service: ``hotspare coordinator --listen ADDR:PORT --state DIR``.

One process is the control plane of many hosts and jobs. Node agents (``hotspare agent
--coordinator ADDR:PORT [--spare]``) register into its pool; `hotspare submit` queues a job;
the service places each queued job once enough hosts are free (``placement``), starts its
rendezvous store in a process of its own (``hotspare.pg.storeproc``) and runs its coordinator
in a ``JobRunner``. Everything it knows is in its SQLite database (``hotspare.service.db``), so
after a crash (``kill -9``) it comes back from there: the jobs that were running resume as
their agents re-register (their workers trained on meanwhile), the queue is kept.

One listener serves both kinds of peer, each proven with the shared secret: node agents
(``agent_hello``, then a lease) and clients (``request``: submit, status, cancel, and inject
where the service allows the fault plug-in). A host works for one job at a time; a node's
events go to the queue of the job it is placed on (``_route``).

Jobs carry a priority (``hotspare.service.priority``): the queue is placed highest first, and a
job that loses a rank with no spare left may borrow a host of a lower-priority preemptible job,
which is paused and requeued to resume from its checkpoint (``hotspare.service.lending``).

Device health is kept in the same database (``hotspare.health.registry`` in a table of it):
each job's health desk watches its hosts' devices (their agents poll them and run their
checks), and placement gives a job only devices in service.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from hotspare.coordinator import events as ev
from hotspare.coordinator.lease import Leases
from hotspare.coordinator.nodes import NodeEndpoint, refuse
from hotspare.errors import ConfigError, ProtocolError
from hotspare.health.lifecycle import IN_SERVICE
from hotspare.protocol.channel import Channel
from hotspare.protocol.lease import welcome_proof
from hotspare.protocol.messages import Message, make
from hotspare.service import db as states
from hotspare.service import hostlife as life
from hotspare.service.clients import Clients, Wake as _Wake
from hotspare.service.db import StateDB
from hotspare.service.hostlife import Agent, HostPhase, HostState
from hotspare.service.jobargs import run_config
from hotspare.service.lending import Lending, ShortOf
from hotspare.service.placement import Host, place
from hotspare.service.priority import queue_order
from hotspare.service.runner import JobRunner
from hotspare.service.stores import start_store, stop_store, store_alive

TICK_S = 1.0              # how often the pool looks at hosts whose release is overdue


@dataclass
class _Host:
    """A host the service knows this run: its agent, the link to it, its phase (``hostlife``)."""
    agent: Agent
    channel: Channel | None
    state: HostState

    def pool_view(self) -> Host:
        return Host(self.agent.name, self.agent.devices, self.agent.spare)


class Service(Clients, Lending):
    def __init__(self, host: str, port: int, secret: bytes, secret_file: str, state_dir: str,
                 lease: float = 3.0, margin: float = 1.0, log: Callable[[str], None] = print,
                 allow_inject: bool = False, observe=None):
        """``allow_inject``: jobs may load the fault plug-in (submit --inject / --allow-inject);
        ``observe(job, coordinator, ledger, health)``: called for each job's coordinator before it
        starts (hotspare.observe.service, --metrics, --dashboard); what it returns (an observer, or
        None) is closed with the job's exit status and report when the job ends."""
        from hotspare.health.reconcile import SlurmReconciler
        from hotspare.health.slurm import mode_from_env
        from hotspare.health.registry import Registry
        self.host, self.secret, self.secret_file = host, secret, os.path.abspath(secret_file)
        self.lease, self.margin, self.log, self.allow_inject = lease, margin, log, allow_inject
        self.observe = observe
        self.db = StateDB(state_dir)
        self.db.hosts_gone()
        # Device health lives in the same database: every job's health desk, and `hotspare
        # health --db DIR/coordinator.db`, read and write it there. Slurm follows it.
        self.registry = Registry(self.db.path)
        self.reconciler = SlurmReconciler.from_mode(self.registry, mode_from_env())
        self.pool_events: "queue.Queue" = queue.Queue()
        # One lock over the hosts, the runners and every change of a job's state in the database
        # (placement's commit and a cancel are transactions under it).
        self._lock = threading.RLock()
        self.hosts: dict[str, _Host] = {}
        self.runners: dict[str, JobRunner] = {}
        self._stop = threading.Event()
        self._lending_init()
        # The checks of a job import torch (its checkpoints): seconds, paid now, not by the first submit.
        threading.Thread(target=_warm_up, name="service-warm-up", daemon=True).start()
        self._resume_jobs()
        self.endpoint = NodeEndpoint(self.pool_events, secret, self._owner, host=host, port=port,
                                     welcome=self._welcome, leases=Leases(lease, margin, self._expired),
                                     route=self._route, clients=self._client)
        self.address = self.endpoint.address

    # ------------------------------------------------------------------ host lifecycle
    def _apply(self, name: str, event: life.HostEvent) -> HostState:
        """Move host ``name`` by ``event`` (under the lock); its new state goes to the database."""
        with self._lock:
            h = self.hosts[name]
            before = h.state
            h.state, why = life.transition(before, event, time.time())
            if h.state != before:
                self.db.host_state(name, h.state.describe())
                if h.state.phase is not before.phase:
                    self.log(f"HOST    {name}: {before.phase} -> {h.state.phase}: {why}")
            return h.state

    def free_hosts(self) -> list[Host]:
        """The idle hosts, each with only its devices in service."""
        with self._lock:
            idle = [h.pool_view() for h in self.hosts.values() if h.state.phase is HostPhase.IDLE]
        return [self.in_service(h) for h in idle]

    # ------------------------------------------------------------------ routing (link threads)
    def _route(self, node: str) -> "queue.Queue":
        with self._lock:
            h = self.hosts.get(node)
            runner = self.runners.get(h.state.job) if h is not None and h.state.phase is HostPhase.BUSY else None
        return runner.events if runner is not None else self.pool_events

    def _owner(self, worker: str) -> str | None:
        job = worker.partition(".")[0]
        with self._lock:
            runner = self.runners.get(job)
        return runner.coord.nodes.owner(worker) if runner is not None else None

    def _welcome(self, hello: Message) -> Message:
        """Before the agent's next line is read: a node that names a job it works for goes
        straight back to that job's queue (what it replays then reaches the job in order)."""
        node, job = hello["node"], hello.get("job")
        resumed = ""
        with self._lock:
            known = self.hosts.get(node)
            if known is not None and known.channel is not None and _closed(known.channel):
                self._apply(node, life.LinkLost())
            free = known is None or known.state.phase is HostPhase.GONE
            if free and isinstance(job, str) and job and job in self.runners and node in self.runners[job].nodes:
                try:
                    agent = Agent.from_hello(hello)
                except ValueError:
                    agent = None
                if agent is not None:
                    self.hosts[node] = _Host(agent, None, known.state if known else HostState())
                    self._apply(node, life.Registered(job))
                    resumed = job
        nonce = hello.get("nonce")
        proof = welcome_proof(self.secret, node, nonce) if isinstance(nonce, str) else ""
        return make("registered", lease=self.lease, proof=proof, job=resumed)

    def _expired(self, node: str, channel: Channel, silent: float) -> None:
        self.log(f"NODE    {node}: no lease renewal for {silent:.1f} s (lease {self.lease:g} s + margin "
                 f"{self.margin:g} s): declared lost")
        self._route(node).put(ev.NodeLost(node, channel, time.time()))
        channel.close()

    # ------------------------------------------------------------------ start and stop
    def serve(self) -> int:
        """Handle the pool's events until ``stop``."""
        self.log(f"coordinator service on {self.address}; state in {self.db.path}; node lease {self.lease:g} s "
                 f"+ margin {self.margin:g} s")
        if self.reconciler is not None:
            self.reconciler.start(log=self.log)
        self._place_queued()
        next_tick = time.time() + TICK_S
        while not self._stop.is_set():
            try:
                event = self.pool_events.get(timeout=max(0.0, min(0.5, next_tick - time.time())))
            except queue.Empty:
                event = None
            if event is not None:
                self._pool_event(event)
            if time.time() >= next_tick:
                next_tick = time.time() + TICK_S
                self._tick()
        if self.reconciler is not None:
            self.reconciler.stop(log=self.log)
        return 0

    def stop(self) -> None:
        self._stop.set()
        self.endpoint.close()

    def _resume_jobs(self) -> None:
        for row in self.db.jobs((states.RUNNING,)):
            state = self.db.load_state(row.id)
            if state is None or row.placement is None or row.store is None:
                self.db.ended(row.id, states.STOPPED, 1, "the coordinator stopped before the job's state was saved",
                              None)
                continue
            try:
                store = store_alive(row.store)
                runner = self._runner(row, store)
            except (ConfigError, OSError, ProtocolError) as e:
                self.db.ended(row.id, states.STOPPED, 1, f"could not be resumed: {e}", None)
                self.log(f"[{row.id}] could not be resumed: {e}")
                continue
            nodes = [*row.placement["hosts"], *row.placement["spare_hosts"]]
            with self._lock:
                self.runners[row.id] = runner
            self.log(f"[{row.id}] resuming: it ran on {', '.join(nodes)}")
            self.db.event("resumed after a restart", row.id)
            runner.start(nodes, resume=state)

    # ------------------------------------------------------------------ the pool (service thread)
    def _pool_event(self, event) -> None:
        if isinstance(event, ev.NodeConnected):
            self._registered(event)
        elif isinstance(event, ev.NodeLost):
            self._link_lost(event)
        elif isinstance(event, _Wake):
            self._place_queued()
        elif isinstance(event, ShortOf):
            self._short(event)
        elif isinstance(event, ev.NodeReleased):
            with self._lock:
                known = event.node in self.hosts
            if known and self._apply(event.node, life.Released(event.job)).phase is HostPhase.IDLE:
                self._place_queued()

    def _link_lost(self, e: ev.NodeLost) -> None:
        with self._lock:
            h = self.hosts.get(e.node)
            if h is None or h.channel is not e.channel:
                return
            runner = self.runners.get(h.state.job) if h.state.phase is HostPhase.BUSY else None
            if runner is None:
                self._apply(e.node, life.LinkLost())
        if runner is not None:         # lost on its way to its job (routed here before it was assigned)
            runner.events.put(e)
        else:
            self.log(f"NODE    {e.node}: left the pool")

    def _tick(self) -> None:
        """A host whose agent did not release its last job in time is cut off (``hostlife``)."""
        with self._lock:
            due = [n for n, h in self.hosts.items() if h.state.phase is HostPhase.RELEASING]
            cut = [self.hosts[n].channel for n in due if self._apply(n, life.Tick()).phase is HostPhase.GONE]
        for ch in cut:
            if ch is not None:
                ch.close()

    def _registered(self, e: ev.NodeConnected) -> None:
        name = e.hello["node"]
        try:
            agent = Agent.from_hello(e.hello)
        except ValueError as err:
            refuse(e.channel, "agent_hello", str(err))
            return
        with self._lock:
            known = self.hosts.get(name)
            if known is not None and known.channel is not None and _closed(known.channel):
                self._apply(name, life.LinkLost())
            taken = known is not None and known.state.phase is not HostPhase.GONE
            if not taken:
                self.hosts[name] = _Host(agent, e.channel, known.state if known else HostState())
                self.db.host(name, list(agent.devices), agent.spare, "idle")
                self._apply(name, life.Registered())
        if taken:
            self.log(f"NODE    refused a second agent named {name!r}")
            refuse(e.channel, "agent_hello", f"a node named {name!r} is already registered")
            return
        if e.hello.get("job"):
            self.log(f"NODE    {name}: its job {str(e.hello['job'])[:64]!r} is not running here; it ends its workers")
        self.log(f"NODE    {name}: registered, {len(agent.devices)} device slot(s)"
                 + (", spare host" if agent.spare else ""))
        self._lend()                          # a job that lost a rank comes first
        if agent.spare:
            self._give_spare(name)
        self._place_queued()

    def _give_spare(self, name: str) -> None:
        """A spare host that joins while a job runs short of spare slots goes to that job."""
        with self._lock:
            wanting = queue_order([r for r in self.runners.values() if r.spare_slots() < r.cfg.capacity.spares
                                   and not r.coord.view.phase.over and r.pausing is None and name not in r.nodes],
                                  key=lambda r: (r.policy.priority, r.started_at))
            if not wanting or self.hosts[name].state.phase is not HostPhase.IDLE:
                return
            runner = wanting[0]
            self._assign(runner, [name], spare_host=True)
        self.log(f"[{runner.job}] spare host {name} joined: its spares go there")

    def _place_queued(self) -> None:
        """Hosts promised to a borrower go to it first, then jobs short of devices for lost
        ranks are served, then the queue is placed, highest priority first, then jobs running
        shrunk grow back."""
        with self._lock:
            self._honour_loans()
        self._lend()
        for row in queue_order(self.db.jobs((states.QUEUED,))):
            nodes, per_node, spares = (int(row.request[k]) for k in ("nodes", "nproc_per_node", "spares"))
            with self._lock:
                queued = (self.db.job(row.id) or row).state == states.QUEUED      # not cancelled since
                where = place(self.free_hosts(), nodes, per_node, spares) if queued else None
                if where is None:
                    continue
                hosts, spare_hosts = where
                for name in [*hosts, *spare_hosts]:
                    self._apply(name, life.Reserved(row.id))
            self._start(row, hosts, spare_hosts, per_node)
        with self._lock:
            self._give_back()              # a job running shrunk (it lent a host) grows back on what is left

    def _start(self, row: states.JobRow, hosts: list[str], spare_hosts: list[str], per_node: int) -> None:
        """Start a job on hosts reserved for it: its store (seconds), its runner, then, as one
        transaction with any cancel, the commit: only a job still queued is placed. A job
        cancelled meanwhile never reaches an agent; its store is stopped, its hosts are free."""
        reserved = [*hosts, *spare_hosts]
        store = runner = None
        try:
            store = start_store(self.host)
            runner = self._runner(row, store)
        except (ConfigError, OSError) as e:
            with self._lock:
                self.db.ended(row.id, states.STOPPED, 2, str(e), None)
                for name in reserved:
                    self._apply(name, life.Unreserved(row.id))
            if store is not None:
                stop_store(store)
            self.log(f"[{row.id}] refused: {e}")
            return
        placement = {"hosts": hosts, "spare_hosts": spare_hosts}
        with self._lock:
            # a host whose link closed meanwhile is no longer reserved: the job waits for others
            left = [n for n in reserved if (self.hosts[n].state.phase, self.hosts[n].state.job)
                    != (HostPhase.RESERVED, row.id)]
            placed = not left and self.db.start_if_queued(row.id, placement, store)
            if placed:
                self.runners[row.id] = runner
                self.db.event(f"placed on {', '.join(hosts)}" + (f", spares on {', '.join(spare_hosts)}"
                                                                  if spare_hosts else ""), row.id)
                runner.start(reserved)
                self._assign(runner, hosts, spare_host=False, per_node=per_node)
                self._assign(runner, spare_hosts, spare_host=True)
            else:
                for name in reserved:
                    self._apply(name, life.Unreserved(row.id))
        if left:
            stop_store(store)
            self.log(f"[{row.id}] not started yet: {', '.join(left)} left while its store started; it stays queued")
            self.pool_events.put(_Wake())
            return
        if not placed:
            stop_store(store)
            self.log(f"[{row.id}] not started: it was cancelled while its rendezvous store started (store stopped)")
            return
        self.log(f"[{row.id}] placed: ranks on {', '.join(hosts)}"
                 + (f", spares on {', '.join(spare_hosts)}" if spare_hosts else ", no spare host yet"))

    def in_service(self, host: Host) -> Host:
        """``host`` with only its devices that may take work (the registry's state of each)."""
        def usable(device: str) -> bool:
            rec = self.registry.find(device)
            return rec is None or rec.state in IN_SERVICE
        return Host(host.name, tuple(d for d in host.devices if usable(d)), host.spare)

    def _assign(self, runner: JobRunner, names: list[str], spare_host: bool, per_node: int | None = None) -> None:
        """(Under the lock.) The hosts ``names`` work for ``runner``'s job from now: each agent
        gets the job's ``assign``, and the job's coordinator takes it in."""
        for name in names:
            h = self.hosts[name]
            self._apply(name, life.Assigned(runner.job))
            usable = self.in_service(h.pool_view()).devices
            devices = list(usable[:per_node] if per_node else usable)
            if name not in runner.nodes:
                runner.nodes.append(name)
            runner.spare_hosts[name] = len(devices) if spare_host else 0
            try:
                h.channel.send(make("assign", job=runner.job, script=runner.cfg.script,
                                    args=list(runner.cfg.script_args), env=runner.worker_env,
                                    devices=devices, telemetry_period=runner.telemetry_period))
            except OSError:
                pass                         # its link closed: the job's coordinator sees it lost
            runner.events.put(ev.NodeConnected(name, h.agent.hello(devices), h.channel, time.time()))

    def _runner(self, row: states.JobRow, store: dict[str, Any]) -> JobRunner:
        cfg = run_config({**row.request, "elastic": row.policy.elastic}, self.host, self.secret_file, self.allow_inject)
        return JobRunner(row.id, cfg, self.db, store, self.lease, self.margin, self.log, self._job_ended,
                         registry=self.registry, observe=self.observe, policy=row.policy, request=row.request,
                         short=lambda job, n, seen: self.pool_events.put(ShortOf(job, n, seen, time.time())),
                         pauses=row.pauses)

    def _job_ended(self, runner: JobRunner) -> None:
        """From the job's thread: its hosts go back to the pool once their agents released it
        (those whose release is still due are asked again: ``shutdown``), its store goes."""
        ask = []
        with self._lock:
            self.runners.pop(runner.job, None)
            released, lost = set(), set()
            while True:                      # what reached the job's queue after its coordinator stopped reading
                try:
                    event = runner.events.get_nowait()
                except queue.Empty:
                    break
                if isinstance(event, ev.NodeReleased) and event.job == runner.job:
                    released.add(event.node)
                elif isinstance(event, ev.NodeLost):
                    lost.add(event.node)
            for name in runner.nodes:
                h = self.hosts.get(name)
                if h is None or h.state.phase is not HostPhase.BUSY or h.state.job != runner.job:
                    continue
                node = runner.coord.nodes.nodes.get(name)
                if h.channel is None and node is not None:      # re-registered with this service for the job
                    h.channel = node.channel
                if h.channel is None or _closed(h.channel) or name in lost:
                    self._apply(name, life.LinkLost())
                    continue
                done = name in released or (node is not None and node.lost and node.channel is h.channel)
                if self._apply(name, life.JobEnded(runner.job, done)).phase is HostPhase.RELEASING:
                    ask.append(h.channel)
        for ch in ask:
            try:
                ch.send(make("shutdown", grace=0.0))
            except OSError:
                pass
        stop_store(runner.store)
        self.pool_events.put(_Wake())


def _warm_up() -> None:
    import importlib
    for module in ("hotspare.checkpoint", "hotspare.service.checks"):
        importlib.import_module(module)


def _closed(ch: Channel) -> bool:
    if ch.closed:            # closed here (its socket's descriptor lives on while its reader is open)
        return True
    try:
        return ch.sock.fileno() < 0
    except OSError:
        return True
