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

Device health is kept in the same database (``hotspare.health.registry`` in a table of it):
each job's health desk watches its hosts' devices (their agents poll them and run their
checks), and placement gives a job only devices in service.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from hotspare.coordinator import events as ev
from hotspare.coordinator.lease import Leases
from hotspare.coordinator.nodes import NodeEndpoint, refuse
from hotspare.errors import ConfigError, ProtocolError
from hotspare.health.lifecycle import IN_SERVICE
from hotspare.protocol import auth
from hotspare.protocol.channel import Channel
from hotspare.protocol.lease import welcome_proof
from hotspare.protocol.messages import Message, make
from hotspare.service import db as states
from hotspare.service.db import StateDB
from hotspare.service.placement import Host, place
from hotspare.service.runner import JobRunner, run_config

MAX_QUEUED = 1000
JOB_ANSWER_S = 10.0       # a running job answers an operator command within this long


@dataclass
class _Pooled:
    """A registered agent's link, while it is in the pool."""
    host: Host
    hello: Message
    channel: Channel


class Service:
    def __init__(self, host: str, port: int, secret: bytes, secret_file: str, state_dir: str,
                 lease: float = 3.0, margin: float = 1.0, log: Callable[[str], None] = print,
                 allow_inject: bool = False):
        """``allow_inject``: jobs may load the fault plug-in (submit --inject / --allow-inject)."""
        from hotspare.health.reconcile import SlurmReconciler
        from hotspare.health.slurm import mode_from_env
        from hotspare.health.registry import Registry
        self.host, self.secret, self.secret_file = host, secret, os.path.abspath(secret_file)
        self.lease, self.margin, self.log, self.allow_inject = lease, margin, log, allow_inject
        self.db = StateDB(state_dir)
        # Device health lives in the same database: every job's health desk, and `hotspare
        # health --db DIR/coordinator.db`, read and write it there. Slurm follows it.
        self.registry = Registry(self.db.path)
        self.reconciler = SlurmReconciler.from_mode(self.registry, mode_from_env())
        self.pool_events: "queue.Queue" = queue.Queue()
        self._lock = threading.Lock()
        self.pool: dict[str, _Pooled] = {}
        self.assigned: dict[str, str] = {}           # node -> the job it works for
        self.runners: dict[str, JobRunner] = {}
        self._stop = threading.Event()
        self._resume_jobs()
        self.endpoint = NodeEndpoint(self.pool_events, secret, self._owner, host=host, port=port,
                                     welcome=self._welcome, leases=Leases(lease, margin, self._expired),
                                     route=self._route, clients=self._client)
        self.address = self.endpoint.address

    # ------------------------------------------------------------------ routing (link threads)
    def _route(self, node: str) -> "queue.Queue":
        with self._lock:
            runner = self.runners.get(self.assigned.get(node, ""))
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
            if isinstance(job, str) and job and job in self.runners and node in self.runners[job].nodes:
                self.assigned[node] = resumed = job
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
        while not self._stop.is_set():
            try:
                event = self.pool_events.get(timeout=0.5)
            except queue.Empty:
                continue
            self._pool_event(event)
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
                store = self._store_alive(row.store)
                runner = self._runner(row.id, row.request, store)
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
            with self._lock:
                pooled = self.pool.get(event.node)
                if pooled is not None and pooled.channel is event.channel:
                    del self.pool[event.node]
            if pooled is not None and pooled.channel is event.channel:
                self.db.host_state(event.node, "gone")
                self.log(f"NODE    {event.node}: left the pool")
        elif isinstance(event, _Wake):
            self._place_queued()
        elif isinstance(event, ev.NodeReleased):
            pass                                 # its job's runner has already handed it back

    def _registered(self, e: ev.NodeConnected) -> None:
        hello = e.hello
        name, spare = hello["node"], hello.get("spare", False)
        if not isinstance(spare, bool):
            refuse(e.channel, "agent_hello", "'spare' must be true or false")
            return
        with self._lock:
            taken = name in self.pool or name in self.assigned
        if taken:
            self.log(f"NODE    refused a second agent named {name!r}")
            refuse(e.channel, "agent_hello", f"a node named {name!r} is already registered")
            return
        if hello.get("job"):
            self.log(f"NODE    {name}: its job {str(hello['job'])[:64]!r} is not running here; it ends its workers")
        host = Host(name, tuple(str(d) for d in hello["devices"]), spare)
        with self._lock:
            self.pool[name] = _Pooled(host, hello, e.channel)
        self.db.host(name, list(host.devices), spare, "idle")
        self.log(f"NODE    {name}: registered, {len(host.devices)} device slot(s)" + (", spare host" if spare else ""))
        if spare:
            self._give_spare(name)
        self._place_queued()

    def _give_spare(self, name: str) -> None:
        """A spare host that joins while a job runs short of spare slots goes to that job."""
        with self._lock:
            wanting = [r for r in self.runners.values() if r.spare_slots() < r.cfg.capacity.spares
                       and not r.coord.view.phase.over]
        if wanting:
            runner = wanting[0]
            self._assign(runner, [name], spare_host=True)
            self.log(f"[{runner.job}] spare host {name} joined: its spares go there")

    def _place_queued(self) -> None:
        for row in self.db.jobs((states.QUEUED,)):
            with self._lock:
                free = [self.in_service(p.host) for p in self.pool.values()]
            where = place(free, int(row.request["nodes"]), int(row.request["nproc_per_node"]),
                          int(row.request["spares"]))
            if where is None:
                continue
            try:
                store = self._start_store()
                runner = self._runner(row.id, row.request, store)
            except (ConfigError, OSError) as e:
                self.db.ended(row.id, states.STOPPED, 2, str(e), None)
                self.log(f"[{row.id}] refused: {e}")
                continue
            hosts, spare_hosts = where
            self.db.started(row.id, {"hosts": hosts, "spare_hosts": spare_hosts}, store)
            self.db.event(f"placed on {', '.join(hosts)}" + (f", spares on {', '.join(spare_hosts)}"
                                                              if spare_hosts else ""), row.id)
            with self._lock:
                self.runners[row.id] = runner
            runner.start([*hosts, *spare_hosts])
            self._assign(runner, hosts, spare_host=False, per_node=int(row.request["nproc_per_node"]))
            self._assign(runner, spare_hosts, spare_host=True)
            self.log(f"[{row.id}] placed: ranks on {', '.join(hosts)}"
                     + (f", spares on {', '.join(spare_hosts)}" if spare_hosts else ", no spare host yet"))

    def in_service(self, host: Host) -> Host:
        """``host`` with only its devices that may take work (the registry's state of each)."""
        def usable(device: str) -> bool:
            rec = self.registry.find(device)
            return rec is None or rec.state in IN_SERVICE
        return Host(host.name, tuple(d for d in host.devices if usable(d)), host.spare)

    def _assign(self, runner: JobRunner, names: list[str], spare_host: bool, per_node: int | None = None) -> None:
        for name in names:
            with self._lock:
                pooled = self.pool.pop(name)
                self.assigned[name] = runner.job
            usable = self.in_service(pooled.host).devices
            devices = list(usable[:per_node] if per_node else usable)
            if name not in runner.nodes:
                runner.nodes.append(name)
            runner.spare_hosts[name] = len(devices) if spare_host else 0
            try:
                pooled.channel.send(make("assign", job=runner.job, script=runner.cfg.script,
                                         args=list(runner.cfg.script_args), env=runner.worker_env,
                                         devices=devices, telemetry_period=runner.telemetry_period))
            except OSError:
                pass                         # its link closed: the job's coordinator sees it lost
            self.db.host_state(name, f"job {runner.job}")
            runner.events.put(ev.NodeConnected(name, {**pooled.hello, "devices": devices}, pooled.channel,
                                               time.time()))

    def _runner(self, job: str, request: dict[str, Any], store: dict[str, Any]) -> JobRunner:
        cfg = run_config(request, self.host, self.secret_file, self.allow_inject)
        return JobRunner(job, cfg, self.db, store, self.lease, self.margin, self.log, self._job_ended,
                         registry=self.registry)

    def _job_ended(self, runner: JobRunner) -> None:
        """From the job's thread: its hosts go back to the pool, its store goes."""
        back = []
        with self._lock:
            self.runners.pop(runner.job, None)
            for name in runner.nodes:
                if self.assigned.get(name) == runner.job:
                    del self.assigned[name]
                    node = runner.coord.nodes.nodes.get(name)
                    if node is not None and node.channel is not None and not _closed(node.channel):
                        hello = {"node": name, "devices": list(node.devices), "spare": name in runner.spare_hosts
                                 and runner.spare_hosts[name] > 0}
                        host = self._host_of(name, node.devices, hello["spare"])
                        self.pool[name] = _Pooled(host, hello, node.channel)
                        back.append(name)
        for name in back:
            self.db.host_state(name, "idle")
        _stop_store(runner.store)
        self.pool_events.put(_Wake())

    def _host_of(self, name: str, devices: list[str], spare: bool) -> Host:
        known = next((h for h in self.db.hosts() if h["name"] == name), None)
        return Host(name, tuple(known["devices"] if known else devices), spare)

    # ------------------------------------------------------------------ stores
    def _start_store(self) -> dict[str, Any]:
        proc = subprocess.Popen([sys.executable, "-m", "hotspare.pg.storeproc", self.host], stdout=subprocess.PIPE,
                                text=True, start_new_session=True)
        line = proc.stdout.readline().strip()
        if not line.isdigit():
            proc.kill()
            raise OSError(f"the job's rendezvous store did not start on {self.host}")
        return {"host": self.host, "port": int(line), "pid": proc.pid}

    def _store_alive(self, store: dict[str, Any]) -> dict[str, Any]:
        try:
            os.kill(int(store["pid"]), 0)
            return store
        except OSError:
            pass
        proc = subprocess.Popen([sys.executable, "-m", "hotspare.pg.storeproc", store["host"], str(store["port"])],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
        if not proc.stdout.readline().strip().isdigit():
            raise OSError(f"the job's rendezvous store could not be started again on {store['host']}:{store['port']}")
        return {**store, "pid": proc.pid}

    # ------------------------------------------------------------------ clients (link threads)
    def _client(self, ch: Channel, msg: Message) -> None:
        origin = f"{msg['operator'][:64]!r} from {auth.peer(ch)}"
        try:
            reply = self._answer(msg["command"], msg["args"], origin)
        except (ConfigError, ProtocolError, KeyError, TypeError, ValueError) as e:
            reply = make("control_reply", ok=False, message=str(e))
            self.log(f"CLIENT  refused {msg['command'][:32]!r} from {origin}: {e}")
        try:
            ch.send(reply)
        except OSError:
            pass
        ch.close()

    def _answer(self, command: str, args: dict[str, Any], origin: str) -> Message:
        if command == "submit":
            return self._submit(args, origin)
        if command == "status":
            jobs = [j.describe() for j in self.db.jobs()]
            job = args.get("job")
            if job is not None:
                jobs = [j for j in jobs if j["id"] == job]
                if not jobs:
                    raise ConfigError(f"no job {str(job)[:64]!r}")
            return make("control_reply", ok=True, message=f"{len(jobs)} job(s)", jobs=jobs, hosts=self._hosts(),
                        report=self.db.report(job) if job is not None else None)
        if command == "cancel":
            job = str(args["job"])
            row = self.db.job(job)
            if row is None:
                raise ConfigError(f"no job {job[:64]!r}")
            with self._lock:
                runner = self.runners.get(job)
            if runner is not None:
                runner.cancel(origin)
            elif row.state == states.QUEUED:
                self.db.ended(job, states.CANCELLED, None, f"cancelled by {origin} before it was placed", None)
            else:
                raise ConfigError(f"job {job} has {row.state}")
            self.log(f"CLIENT  {origin} cancelled {job}")
            return make("control_reply", ok=True, message=f"job {job} cancelled")
        if command == "inject":
            return self._to_job(str(args["job"]), {"type": "inject", "spec": str(args["spec"])[:1000]}, origin)
        raise ConfigError(f"unknown command {command[:32]!r}: submit, status, cancel or inject")

    def _hosts(self) -> list[dict[str, Any]]:
        """Every host the service knows, with its devices out of service (the registry's)."""
        out = {r.device: r.state.value for r in self.registry.devices() if r.state not in IN_SERVICE}
        return [{**h, "out_of_service": {d: out[d] for d in h["devices"] if d in out}} for h in self.db.hosts()]

    def _to_job(self, job: str, msg: Message, origin: str) -> Message:
        """An operator command for a running job's coordinator (``Coordinator.command``); its answer."""
        with self._lock:
            runner = self.runners.get(job)
        if runner is None:
            row = self.db.job(job)
            raise ConfigError(f"no job {job[:64]!r}" if row is None else f"job {job} is not running ({row.state})")
        answer: "queue.Queue[Message]" = queue.Queue()
        runner.events.put(ev.OperatorCommand(msg, origin, answer.put, time.time()))
        try:
            return answer.get(timeout=JOB_ANSWER_S)
        except queue.Empty:
            raise ConfigError(f"job {job} did not answer within {JOB_ANSWER_S:g} s") from None

    def _submit(self, args: dict[str, Any], origin: str) -> Message:
        request = {"script": str(args["script"]), "args": [str(a) for a in args["args"]],
                   "nodes": int(args["nodes"]), "nproc_per_node": int(args["nproc_per_node"]),
                   "spares": int(args["spares"]), "run_args": [str(a) for a in args.get("run_args", [])]}
        if not 1 <= request["nodes"] <= 4096 or not 1 <= request["nproc_per_node"] <= 4096:
            raise ConfigError("--nodes and --nproc-per-node must be 1..4096")
        if len(self.db.jobs((states.QUEUED,))) >= MAX_QUEUED:
            raise ConfigError(f"{MAX_QUEUED} jobs are queued already")
        from hotspare.cli.preflight import preflight
        preflight(run_config(request, self.host, self.secret_file, self.allow_inject))  # refuse a bad job now
        job = self.db.next_job_id()
        self.db.submit(job, request)
        self.db.event(f"submitted by {origin}", job)
        self.log(f"[{job}] submitted by {origin}: {request['nodes']} node(s) x {request['nproc_per_node']} + "
                 f"{request['spares']} spare(s): {request['script']}")
        self.pool_events.put(_Wake())
        return make("control_reply", ok=True, message=f"submitted {job}", job=job)


class _Wake:
    """Look at the queue again (a job was submitted or a job ended)."""


def _closed(ch: Channel) -> bool:
    try:
        return ch.sock.fileno() < 0
    except OSError:
        return True


def _stop_store(store: dict[str, Any]) -> None:
    try:
        os.kill(int(store["pid"]), signal.SIGTERM)
    except (OSError, KeyError, ValueError):
        pass
