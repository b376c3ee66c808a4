"""The coordinator: membership, generations, the spare pool and recovery, driven by events.

One thread consumes the event queue in order (the node agents' messages, see ``nodes``; the
telemetry poller; operator commands). Each event becomes either bookkeeping
(heartbeats, commits: the ledger) or a ``Signal`` for the pure policy: ``observe`` records it,
``decide`` returns actions and a reason, the coordinator executes them and ``apply`` records
their effect. Every control message it sends carries the generation, so stale ones are refused.
"""
from __future__ import annotations

import os
import queue
import signal
import sys
import time
from typing import Any, Callable

from hotspare.agent import describe_exit
from hotspare.agent.inject import Fault, parse
from hotspare.coordinator.ledger import FailureRecord, Ledger, MigrationRecord
from hotspare.coordinator.nodes import Nodes, refuse
from hotspare.coordinator.trust import check_claims
from hotspare.errors import ConfigError, ProtocolError
from hotspare.health.registry import RegistryError
from hotspare.policy import decide as policy
from hotspare.policy import hang
from hotspare.protocol.messages import make


FENCE_STACKS_S = 0.2    # a fenced worker's moment to write its stacks (SIGUSR1) before the SIGKILL
PREEMPT_TIMEOUT_S = 20.0   # SIGTERM/SIGINT: time for the last checkpoint (schedulers SIGKILL after ~30 s)


def _fmt_ranks(ranks) -> str:
    return ",".join(map(str, ranks))


class Coordinator:
    def __init__(self, nodes: Nodes, events: "queue.Queue", view: policy.ClusterView,
                 ledger: Ledger, log: Callable[[str], None] = print, log_every: int = 0,
                 hang_floor: float = hang.DEFAULT_FLOOR_S, hang_factor: float = hang.DEFAULT_FACTOR,
                 join_timeout: float = 5.0, checkpoint_dir: str = "hotspare-checkpoints",
                 health=None, faults: list[Fault] = (), checkpoint_key: bytes | None = None,
                 preempt_timeout: float = PREEMPT_TIMEOUT_S):
        self.nodes, self.events, self.view, self.ledger = nodes, events, view, ledger
        for fault in faults:                    # from the command line: armed on every node
            self.nodes.arm(str(fault), running=False)
        self.log = log
        self.log_every = log_every
        self.hang_floor, self.hang_factor, self.join_timeout = hang_floor, hang_factor, join_timeout
        self.joined: set[int] = set()           # ranks that finished joining the current generation
        self.committed_in_gen = False
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_key = checkpoint_key
        self.restoring: str | None = None       # the checkpoint this generation restores, until it commits
        self.failed_restores: set[str] = set()  # checkpoints the workers could not restore
        self._vetted: set[str] = set()          # checkpoints verified for the restore being decided
        self.preempt_timeout = preempt_timeout
        self.preempted: tuple[str, int, float] | None = None   # (signal, exit code, deadline)
        self._preempt_asked = False             # ... and a survivor was asked for the last checkpoint
        self.progress_at = time.time()          # last commit, or the current generation forming
        self.recovering_since: float | None = None
        self.reducing: dict[int, int] = {}      # rank -> last step whose exchange it entered
        self._probed_at = 0.0                   # when the ranks were last asked where they are
        self.fenced: dict[str, tuple[float, str]] = {}
        self.injected_at: dict[str, tuple[Any, float]] = {}
        self.exit_code: int | None = None
        self.debug = bool(os.environ.get("HOTSPARE_DEBUG"))
        self.health = health                    # coordinator.health.HealthMonitor, or None
        self._health_said: set[tuple[str, str]] = set()
        self._operator_polled = 0.0
        self.unplaced = 0                       # spares wanted but no usable device was free
        self._next_tick = 0.0

    # ------------------------------------------------------------------ life cycle
    def start(self, nodes: int = 1, timeout: float = 30.0) -> None:
        """Wait for ``nodes`` node agents to connect, then start the ranks and the spare pool."""
        deadline = time.time() + timeout
        while len(self.nodes.live_nodes()) < nodes:
            try:
                kind, worker, payload, t = self.events.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                raise ConfigError(f"{len(self.nodes.live_nodes())} of {nodes} node agent(s) connected "
                                  f"within {timeout:.0f} s") from None
            self._handle(kind, worker, payload, t)
        for rank in range(self.view.world_size):
            if self.nodes.spawn("active", rank=rank) is None:
                raise ConfigError(f"only {len(self.nodes.free_devices())} usable device(s) for "
                                  f"{self.view.world_size} ranks: uncordon devices (hotspare uncordon) or "
                                  "lower --nproc")
        self._spawn_spares(self.view.target_spares)   # the initial pool: not replacements
        self.view.starting += self.view.target_spares

    def stop_nodes(self, grace: float) -> None:
        """Ask every node agent to end its workers (SIGKILL after ``grace`` seconds) and wait
        for the links to close. Only the picture of the workers is kept current meanwhile: no
        decision is taken on a job that is ending."""
        self.nodes.shutdown(grace)
        deadline = time.time() + grace + 5.0
        while self.nodes.live_nodes() and time.time() < deadline:
            try:
                kind, who, payload, _ = self.events.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                break
            if kind == "node_lost":
                self.nodes.lose(who, payload)
            elif kind in ("exit", "started", "stopped"):
                self.nodes.observe(kind, who, payload)
        for name in [n.name for n in self.nodes.live_nodes()]:
            self.log(f"NODE    {name}: its agent did not close its link within {grace + 5.0:.0f} s")

    def _spawn_spares(self, count: int) -> int:
        """Start spares; one that no usable device can take waits (counted as starting) until a
        device returns to service."""
        started = 0
        for _ in range(count):
            if self.nodes.spawn("spare") is None:
                self.unplaced += 1
                self.log("CAPACITY no usable device is free for a new spare (devices out of service: "
                         "see `hotspare health`); it starts when a device returns to the pool")
            else:
                started += 1
        return started

    def run(self, poll: float | None = None) -> int:
        """Handle events until the job ends and its workers are gone; the exit status."""
        while not self.over():
            self.step(poll)
        return self.exit_code if self.exit_code is not None else 1

    def step(self, poll: float | None = None) -> None:
        """Handle the next event, waiting for one until the next tick is due, then tick if it is.
        Ticks come every ``poll`` seconds, or by default as often as hang detection needs
        (``policy.hang.tick_period``: a tenth of the threshold, 0.25-1 s)."""
        try:
            kind, worker, payload, t = self.events.get(timeout=max(0.0, self._next_tick - time.time()))
        except queue.Empty:
            kind = None
        if kind is not None:
            self._handle(kind, worker, payload, t)
        now = time.time()
        if now >= self._next_tick:
            limit = hang.threshold(self.ledger.step_times, self.hang_floor, self.hang_factor)
            self._next_tick = now + (poll if poll is not None else hang.tick_period(limit))
            self._tick(now, limit)

    def over(self) -> bool:
        return self.view.phase in ("finished", "stopped") and not self.nodes.alive()

    # ------------------------------------------------------------------ events
    def _handle(self, kind: str, worker: str, payload: Any, t: float) -> None:
        if self.debug and not (kind == "msg" and payload["type"] in ("step", "commit")):
            self.log(f"debug   event {kind} from {worker}: {payload}")
        if kind in ("node", "node_lost", "refused"):
            self._node_event(kind, worker, payload, t)
            return
        if kind == "preempt":
            self._preempt(payload["signal"], payload["code"], t)
            return
        if kind == "msg" and worker in self.nodes.workers:
            try:
                check_claims(payload, self.nodes.workers[worker].rank, self.view.generation, self.view.world_size)
            except ProtocolError as e:
                print(f"hotspare: refusing a message from worker {worker}: {e}", file=sys.stderr, flush=True)
                return
        info = self.nodes.observe(kind, worker, payload)
        if kind in ("msg", "exit", "started", "stopped", "injected") and info is None:
            print(f"hotspare: ignoring {kind} about unknown worker {worker!r}", file=sys.stderr)
            return
        if kind in ("started", "stopped"):
            return
        if kind == "injected":
            self.nodes.fired(payload["id"], worker)
            try:
                fault = parse(payload["fault"], running=True)
            except ConfigError as e:
                print(f"hotspare: an agent reported an unreadable fault: {e}", file=sys.stderr)
                return
            self.injected_at[worker] = (fault, t)
            how = {"device": "its device's simulated telemetry", "worker": "the worker itself"}.get(
                fault.target) or (fault.signal.name if fault.signal else f"exit with status {fault.code}")
            self.log(f"FAULT   injected {fault} -> {how} to worker {worker} (pid {info.pid})")
            return
        if kind == "readings":
            self._readings(payload, t)
            return
        if kind == "control":
            msg, reply = payload
            reply(self._control(msg))
            return
        if kind == "exit":
            self._worker_gone(worker, payload["code"], describe_exit(payload["code"]), t)
            return
        msg = payload
        try:
            sig = self._to_signal(worker, msg, t)
        except (KeyError, TypeError, ValueError, AttributeError, ProtocolError) as e:
            # Well-formed by the schema yet unusable here: refused, the job goes on.
            print(f"hotspare: ignoring bad message from {worker}: {type(e).__name__}: {e}", file=sys.stderr)
            return
        if sig is not None:
            self._signal(sig, t)

    def _node_event(self, kind: str, name: str, payload: Any, t: float) -> None:
        if kind == "node":
            hello, channel = payload
            try:
                node = self.nodes.add(hello, channel)
            except ProtocolError as e:
                self.log(f"NODE    refused an agent: {e}")
                refuse(channel, "agent_hello", str(e))
                return
            slots = f"{len(node.devices)} device slot(s)" if node.devices else "no device slots"
            self.log(f"NODE    {name}: agent pid {node.pid} connected, {slots}")
        elif kind == "refused":
            self.log(f"NODE    {name} refused {payload['command']!r}: {payload['message']}")
        else:
            if name in self.nodes.nodes and self.nodes.nodes[name].channel is not payload:
                return                  # a link refused above
            lost = self.nodes.lose(name, payload)
            if lost or self.view.phase not in ("finished", "stopped"):
                self.log(f"NODE    {name}: the link to its agent closed; {len(lost)} worker(s) lost with it")
            for w in lost:
                self.nodes.workers[w].exit_code = -signal.SIGKILL
                self._worker_gone(w, -signal.SIGKILL, f"was lost with node {name}", t, node_lost=True)

    def _worker_gone(self, worker: str, code: int, desc: str, t: float, node_lost: bool = False) -> None:
        wp = self.nodes.workers[worker]
        if (wp.role == "spare" and worker not in self.view.ready_workers and code < 0
                and self.view.phase not in ("finished", "stopped")):
            self.log(f"SPARE   {worker} {desc} while it started; another spare takes its place")
        if (self.restoring and code > 0 and not self.committed_in_gen
                and self.view.rank_of(worker) is not None and self.restoring not in self.failed_restores):
            # It ended on its own before the restored generation committed: it could not load it.
            self.failed_restores.add(self.restoring)
            self.log(f"CHECKPOINT {self.restoring}: rank {self.view.rank_of(worker)} ({worker}) {desc} while "
                     "restoring it (see its output above); it will not be tried again")
        self._member_lost(worker, desc, code, t, kind="node lost" if node_lost else None)
        self._signal(policy.WorkerExited(worker, code, desc, node_lost,
                                         spare=self.nodes.workers[worker].role == "spare"), t)
        if self.health is not None:
            self.health.device_released(self.nodes.workers[worker].device)

    def _tick(self, now: float, limit: float) -> None:
        """``limit``: the hang threshold for the steps seen so far (``policy.hang.threshold``)."""
        if self.view.phase not in ("running", "recovering"):
            return
        if self.preempted is not None and self._preempt_progress(now):
            return
        if self.health is not None and now - self._operator_polled >= 1.0:
            self._operator_polled = now
            try:
                requests = self.health.operator_requests()
            except RegistryError as e:          # e.g. out of file descriptors for a moment
                self.log(f"HEALTH  operator commands not read this time: {e}")
                requests = []
            for verdict in requests:
                self.log(f"OPERATOR {verdict.device}: {verdict.reason}")
                self._act_on(verdict, now, "registry")
        while self.unplaced and self.nodes.free_devices():
            self.unplaced -= 1
            if self.nodes.spawn("spare") is None:
                self.unplaced += 1
                break
            self.log("CAPACITY a device is back in the pool: starting the spare that waited for it")
        activity = tuple(
            hang.RankActivity(r, self.nodes.workers[w].last_step, self.reducing.get(r),
                              self.nodes.workers[w].stopped)
            for r, w in sorted(self.view.members.items()) if r not in self.view.lost)
        # Forming a group may legitimately take up to the join timeout (a member that died after
        # publishing its address is retried until then), and a generation's first step follows
        # a state transfer: be lenient until the generation has committed a step.
        if self.view.phase == "recovering":
            limit += 2 * self.join_timeout
        elif len(self.joined) < len(self.view.members) or not self.committed_in_gen:
            limit += self.join_timeout
        since = 0.0 if self.recovering_since is None else now - self.recovering_since
        self._probe(now, now - self.progress_at, limit)
        self._signal(policy.Tick(activity, now - self.progress_at, since, limit), now)

    def _probe(self, now: float, stalled: float, limit: float) -> None:
        """Past half the hang threshold, ask every rank (again every tenth of it) which step's
        gradient exchange it entered last; the answers ("reducing") reach the hang detector
        before the threshold. A rank that cannot answer keeps its older answer: it is behind."""
        if self.view.phase != "running" or stalled < limit / 2 or now - self._probed_at < max(0.2, limit / 10):
            return
        self._probed_at = now
        for r, w in self.view.members.items():
            if r not in self.view.lost:
                self.nodes.send(w, make("probe", gen=self.view.generation))

    def _to_signal(self, worker: str, msg: dict[str, Any], t: float) -> policy.Signal | None:
        kind = msg["type"]
        if kind in ("joining", "transfer"):
            return None                 # heartbeats of a recovery (and fault-injection triggers)
        if kind == "reducing":
            if msg["gen"] == self.view.generation:
                self.reducing[msg["rank"]] = msg["step"]
            return None
        if kind == "ready":
            wp = self.nodes.workers[worker]
            if self.view.phase in ("finished", "stopped"):
                self.nodes.send(worker, make("release", reason=f"job {self.view.phase}"))
                return None
            return policy.WorkerReady(worker, wp.role, wp.rank if wp.role == "active" else None)
        if kind == "commit":
            if msg["gen"] != self.view.generation:
                return None             # stale: a commit of a generation already replaced
            self._on_commit(msg, t)
            if self.health is not None and isinstance(msg.get("compute"), (int, float)):
                self._health_readings(self.health.step_timing(msg["rank"], float(msg["compute"]),
                                                              float(msg.get("comm", 0.0)), t), t)
            return None
        if kind == "step":
            if self.ledger.total_steps is None and isinstance(msg.get("total"), int):
                self.ledger.total_steps = msg["total"]
            return None
        if kind == "joined":
            self._on_joined(msg, t)
            return None
        if kind == "failed":
            health = msg.get("health")
            if isinstance(health, dict) and msg["gen"] == self.view.generation:
                said = ("vote", msg["gen"], health.get("step"))
                if said not in self._health_said:     # every rank reports the same verdict
                    self._health_said.add(said)
                    self.log(f"VOTE    {str(health.get('detail', ''))[:500]}")
            if isinstance(health, dict) and self.health is not None and msg["gen"] == self.view.generation:
                # Judge the suspects before the step failure is counted: they must not be a source.
                self._health_readings(self.health.vote_readings(health, t), t, step=health.get("step"))
            return policy.StepFailed(worker, msg["rank"], msg["gen"], msg["committed"], msg["error"])
        if kind == "paused":
            m = next((m for m in reversed(self.ledger.migrations) if m.generation is None), None)
            if m is not None:
                m.stopped_at = min(m.stopped_at or t, t)
                m.paused_at = max(m.paused_at or 0.0, t)
            return policy.Paused(worker, msg["rank"], msg["gen"], msg["committed"])
        if kind == "handed_off":
            for m in self.ledger.migrations:
                if m.generation == msg["gen"]:
                    m.bytes_transferred, m.transfer_s = msg["bytes"], float(msg["seconds"])
            return None
        if kind == "crash":
            self.log(f"ERROR   rank {msg['rank']} ({worker}) raised at step {msg['step']}: {msg['error'][:200]}")
            return policy.Crashed(worker, msg["rank"], msg["gen"], msg["step"], msg["error"], msg["traceback"])
        if kind == "checkpointed":
            from hotspare.checkpoint import within    # here: the control CLI imports this module without torch
            if not within(msg["path"], [self.checkpoint_dir]):
                self.log(f"CHECKPOINT refused {worker}'s report of {msg['path']!r}: it is outside the job's "
                         f"checkpoint directory {self.checkpoint_dir}")
                return None
            self.ledger.checkpoints.append({"step": msg["step"], "path": msg["path"], "generation": msg["gen"]})
            return policy.Checkpointed(msg["step"], msg["path"])
        if kind == "done":
            self.ledger.digests[msg["rank"]] = msg["digest"]
            if isinstance(msg.get("rank_digest"), str):
                self.ledger.rank_digests[msg["rank"]] = msg["rank_digest"]
            return policy.Done(worker, msg["rank"], msg["gen"], msg["step"], msg["digest"])
        raise ProtocolError(f"unexpected {kind!r} from a worker")

    def _signal(self, sig: policy.Signal, t: float) -> policy.Decision:
        self.view.job_step = self.ledger.max_committed()
        policy.observe(self.view, sig)
        self._vet_checkpoint()          # with this signal's facts, before the policy may order a restore
        decision = policy.decide(self.view, sig, t)
        if self.debug and not (isinstance(sig, policy.Tick) and not decision.actions):
            self.log(f"debug   decide {type(sig).__name__} phase={self.view.phase} -> {decision}")
        for action in decision.actions:
            self._execute(action, decision.reason, t)
            policy.apply(self.view, action)
        if self.view.phase == "recovering" and self.recovering_since is None:
            self.recovering_since = t
        elif self.view.phase != "recovering":
            self.recovering_since = None
        return decision

    def _control(self, msg: dict[str, Any]) -> dict[str, Any]:
        """An operator command from the control endpoint (authenticated; ``origin`` says by
        whom, from where); a bad one changes nothing, and is logged too."""
        origin = msg.get("origin", "?")
        if self.view.phase in ("finished", "stopped"):
            return make("control_reply", ok=False, message=f"the job has {self.view.phase}")
        try:
            fault = parse(msg["spec"], world_size=self.view.world_size, running=True)
        except ConfigError as e:
            self.log(f"OPERATOR refused inject {msg['spec'][:100]!r} from {origin}: {str(e).splitlines()[0]}")
            return make("control_reply", ok=False, message=str(e))
        if fault.target == "device" and not self.nodes.device_faults():
            return make("control_reply", ok=False, message=f"{fault.kind} faults need simulated telemetry "
                        "(hotspare run --telemetry simulated)")
        self.nodes.arm(str(fault), running=True)
        when = f"at step {fault.step}" if fault.step is not None else "at its next step"
        self.log(f"OPERATOR inject {fault} from {origin}: fires on rank {fault.rank} {when}")
        return make("control_reply", ok=True, message=f"{fault} armed: fires on rank {fault.rank} {when}")

    # ------------------------------------------------------------------ health
    def _readings(self, readings, t: float) -> None:
        """A telemetry poll (queued by the poller thread)."""
        self.health.record_readings(readings)
        self._health_readings(readings, t)

    def _health_readings(self, readings, t: float, step: int | None = None) -> None:
        for reading in readings:
            verdict = self.health.observe(reading, t)
            if verdict is not None:
                self._act_on(verdict, t, reading.source, step)

    def _act_on(self, verdict, t: float, source: str, step: int | None = None) -> None:
        """A verdict becomes a signal for the pure policy, like any failure."""
        if self.view.phase in ("finished", "stopped"):
            return
        worker = self.view.members.get(verdict.rank, "") if verdict.rank is not None else ""
        self.ledger.health_events.append({
            "time": round(t - self.ledger.started, 3), "device": verdict.device, "rank": verdict.rank,
            "action": verdict.action, "rule": verdict.rule, "reason": verdict.reason,
            "trust_memory": verdict.trust_memory, "source": source})
        decision = self._signal(policy.HealthVerdict(verdict.device, verdict.rank, verdict.action,
                                                     verdict.reason, verdict.trust_memory, verdict.rule,
                                                     step, worker), t)
        said = (verdict.device, decision.reason.split(":")[0])
        if not decision.actions and said not in self._health_said:   # e.g. no spare to move to
            self._health_said.add(said)
            self.log(f"HEALTH  {decision.reason}")

    # ------------------------------------------------------------------ bookkeeping
    def _on_commit(self, msg: dict[str, Any], t: float) -> None:
        rank, step = msg["rank"], msg["step"]
        total = msg.get("total")
        if self.ledger.total_steps is None and isinstance(total, int):
            self.ledger.total_steps = total
        elif isinstance(total, int) and total != self.ledger.total_steps and self.view.phase != "stopped":
            # Ranks that disagree on job.steps(total) would wait for each other forever at the end.
            stop = policy.Stop(1, f"ranks disagree on job.steps(total): rank {rank} runs {total} steps, "
                                  f"the job {self.ledger.total_steps}. Every rank must pass the same total "
                                  "(a value computed from the rank or world size before init() differs on a spare)")
            self._execute(stop, stop.message, t)
            policy.apply(self.view, stop)
            return
        self.progress_at = max(self.progress_at, t)
        self.committed_in_gen = True
        self.restoring = None
        check, fp, check_cpu = (msg.get(k) if isinstance(msg.get(k), (int, float)) else None
                                for k in ("check", "fp", "check_cpu"))
        recovered = self.ledger.commit(rank, step, float(msg["dt"]), msg["gen"], self.view.world_size, t,
                                       check, fp, check_cpu)
        if recovered:
            for m in self.ledger.migrations:
                if m.generation == msg["gen"] and m.first_commit_at == t:
                    self.log(f"MIGRATED rank {m.rank} off {m.device} -> {m.spare}: state of step "
                             f"{m.target_step} ({m.bytes_transferred / 1e6:.1f} MB in {m.transfer_s * 1000:.0f} ms) "
                             f"handed over directly; downtime {m.first_commit_at - m.signal_at:.2f} s from the "
                             f"signal to the next committed step, lost steps 0")
            for f in self.ledger.failures:
                if f.generation == msg["gen"] and f.first_commit_at == t:
                    src = "the checkpoint" if f.recovery_path == "checkpoint" else f"rank {f.source_rank}"
                    self.log(f"RESUMED rank {f.rank} -> {self._where(f.replacement or f.worker)}: state of step "
                             f"{f.target_step} ({f.bytes_transferred / 1e6:.1f} MB in {f.transfer_s * 1000:.0f} ms) "
                             f"from {src}; first step committed; downtime "
                             f"{f.first_commit_at - f.start:.2f} s, lost steps {f.lost_steps}")
        every = self.log_every or max(1, (self.ledger.total_steps or 20) // 20)
        if rank == 0 and (step % every == 0 or step + 1 == (self.ledger.total_steps or -1)):
            metrics = msg.get("metrics") or {}
            extra = "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
            total = f"/{self.ledger.total_steps}" if self.ledger.total_steps else ""
            self.log(f"step {step:>5}{total}  {extra}  {msg['dt'] * 1000:.0f} ms/step  gen {msg['gen']}")

    def _on_joined(self, msg: dict[str, Any], t: float) -> None:
        for m in self.ledger.migrations:
            if m.generation == msg["gen"]:
                m.rebuild_s = max(m.rebuild_s, float(msg["timings"].get("rebuild", 0.0)))
        if msg["gen"] == self.view.generation:
            self.joined.add(msg["rank"])
            self.progress_at = max(self.progress_at, t)     # the stall clock starts once joined
        for f in self.ledger.open:
            if f.generation == msg["gen"]:
                f.joined_at = max(f.joined_at or 0.0, t)
                f.rebuild_s = max(f.rebuild_s, float(msg["timings"].get("rebuild", 0.0)))
                f.transfer_s = max(f.transfer_s, float(msg["timings"].get("transfer", 0.0)))
                f.bytes_transferred = max(f.bytes_transferred, msg["bytes"])

    def _where(self, worker: str) -> str:
        """A worker's name, and its node's when the job spans several."""
        info = self.nodes.workers.get(worker)
        return f"{worker} on {info.node}" if info is not None and len(self.nodes.nodes) > 1 else worker

    def _member_lost(self, worker: str, desc: str, code: int, t: float, kind: str | None = None) -> None:
        rank = self.view.rank_of(worker)
        if rank is None or self.view.phase not in ("running", "recovering") or rank in self.view.done:
            return
        wp = self.nodes.workers[worker]
        crash = next((c for c in reversed(self.view.crashes) if c.worker == worker), None)
        injected = self.injected_at.get(worker)
        fenced = self.fenced.get(worker)
        if fenced:
            kind, t = fenced[2], fenced[0]               # detected when the detector fired
        elif crash:
            kind = "exception"
        elif kind is not None:
            pass
        else:
            kind = describe_exit(code).split(" by ")[-1] if code < 0 else f"exit {code}"
        # The step it was in: its own reports say (None: it never ran one), or, as ranks > 0
        # report commits in batches, the step after the job's newest commit (rank 0 reports each
        # at once), if that is later.
        step = None if wp.last_step is None else max(wp.last_step, self.ledger.max_committed() + 1)
        rec = FailureRecord(kind=kind, rank=rank, worker=worker, step=step, detected_at=t,
                            fault_at=injected[1] if injected else None,
                            error=crash.error if crash else None,
                            spare_was_warm=bool(self.view.ready_spares))
        self.ledger.failures.append(rec)
        self.ledger.open.append(rec)
        latency = f"; detected in {(t - rec.fault_at) * 1000:.0f} ms" if rec.fault_at else ""
        self.log(f"FAILED  rank {rank} ({self._where(worker)}, pid {wp.pid}) {desc} at step {step}{latency}")

    # ------------------------------------------------------------------ actions
    def _execute(self, action: policy.Action, reason: str = "", t: float | None = None) -> None:
        t = time.time() if t is None else t
        if isinstance(action, policy.FormGeneration):
            self._form(action, reason)
        elif isinstance(action, policy.AbortGeneration):
            for r in action.ranks:
                self.nodes.send(self.view.members[r], make("abort", gen=action.gen, reason=reason))
        elif isinstance(action, policy.Fence):
            workers = [self.view.members[r] for r in action.ranks]
            for w in workers:     # where was it? every thread's stack goes to its stderr first
                self.nodes.kill(w, signal.SIGUSR1, group=False)
            time.sleep(FENCE_STACKS_S)
            for r, worker in zip(action.ranks, workers):
                self.fenced[worker] = (t, action.reason, action.kind)
                self.log(f"FENCE   rank {r} ({worker}): {action.reason}; SIGKILL to its process group "
                         "(its threads' stacks are above, from faulthandler)")
                self.nodes.kill(worker, signal.SIGKILL, group=True)
        elif isinstance(action, policy.CheckpointNow):
            self.log(f"STOPPING {action.reason} Rank {action.rank} writes a last checkpoint to "
                     f"{self.checkpoint_dir}")
            self.nodes.send(self.view.members[action.rank], make("checkpoint_now", directory=self.checkpoint_dir))
        elif isinstance(action, policy.StartSpares):
            self._spawn_spares(action.count)
        elif isinstance(action, policy.Pause):
            worker = self.view.members[action.rank]
            injected = self.injected_at.get(worker)
            self.ledger.migrations.append(MigrationRecord(
                action.rank, action.device, action.rule, action.reason, t, action.spare, worker,
                fault_at=injected[1] if injected else None))
            self.log(f"MIGRATE {action.reason}")
            for r, w in self.view.members.items():
                self.nodes.send(w, make("pause", gen=action.gen, reason=action.reason))
        elif isinstance(action, policy.Cordon):
            if self.health is not None:
                self.health.cordon(action.device, action.reason, action.rule, t, retire=action.retire)
        elif isinstance(action, policy.Release):
            self.ledger.outcome = "finished"
            for m in self.ledger.migrations:
                if m.outcome == "in flight":
                    m.outcome = "not needed: training finished first"
            self._release_all(action.reason)
            self.exit_code = 0
        elif isinstance(action, policy.Stop):
            self.ledger.outcome, self.ledger.message = "stopped", action.message
            for f in self.ledger.open:
                f.recovery_path = f.recovery_path or "stopped"
            if self.preempted is not None:
                self.ledger.outcome = "preempted"
            self.log(f"STOP    {action.message}")
            self._release_all("job stopped")
            for w in self.nodes.alive():
                self.nodes.kill(w)
            self.exit_code = self.preempted[1] if self.preempted is not None else action.code

    # ------------------------------------------------------------------ checkpoints
    def _vet_checkpoint(self) -> None:
        """Before the policy may order a restore (generation 1 of --resume, or every copy lost),
        the checkpoint it would use must verify (MAC, every file's digest) and not have failed a
        restore already; else the newest older one that does takes its place, said in the log
        and the report. With none left the view holds no checkpoint, and the policy stops the
        job instead of restoring forever."""
        v = self.view
        if v.phase == "starting" and v.resume:
            path = v.resume
        elif v.phase == "recovering" and v.checkpoint is not None and self._no_copy_left():
            path = v.checkpoint.path
        else:
            return
        if path in self._vetted:
            return
        from hotspare.checkpoint import CheckpointError, newest_valid, verify
        try:
            if path in self.failed_restores:
                raise CheckpointError("the workers could not restore it")
            verify(path, self.checkpoint_key)
            self._vetted.add(path)
            return
        except (CheckpointError, ConfigError) as e:    # ConfigError: the key file itself
            why = str(e)
        root = os.path.dirname(path.rstrip(os.sep))
        try:
            info, refused = newest_valid(root, self.checkpoint_key)
        except ConfigError as e:
            info, refused = None, [(root, str(e))]
        if info is not None and info.path in self.failed_restores:
            info = None
        self.ledger.checkpoint_fallbacks.append({"refused": path, "reason": why, "used": info and info.path,
                                                 "step": info and info.step})
        if info is None:
            self.log(f"CHECKPOINT refused {path}: {why}; no other checkpoint in {root} verifies"
                     + "".join(f"; {p}: {r}" for p, r in refused if p != path))
            if v.phase == "starting":
                self._stop_now(f"--resume: no usable checkpoint ({why})", time.time())
            else:
                v.checkpoint = None
            return
        self.log(f"CHECKPOINT refused {path}: {why}; falling back to the older checkpoint of step {info.step} "
                 f"({info.path})")
        self._vetted.add(info.path)
        if v.phase == "starting":
            v.resume = info.path
        else:
            v.checkpoint = policy.Checkpointed(info.step, info.path)

    def _no_copy_left(self) -> bool:
        """Every survivor has reported and none holds the state (as ``plan_recovery`` judges:
        a survivor more than a step behind the job is no copy): the next plan is a restore."""
        v = self.view
        if set(v.members) - v.lost - set(v.reports):
            return False
        return not any(s >= v.job_step - 1 for s in v.reports.values())

    def _preempt(self, signame: str, code: int, t: float) -> None:
        """SIGTERM or SIGINT to the launcher: a survivor writes a last checkpoint from memory
        (as when capacity runs out), then the job stops with ``code``; at most
        ``preempt_timeout`` seconds."""
        if self.view.phase in ("finished", "stopped") or self.preempted is not None:
            return
        self.preempted = (signame, code, t + self.preempt_timeout)
        what = "interrupted by the user" if signame == "SIGINT" else "terminated"
        reason = f"{what} ({signame}): stopping after a last checkpoint."
        self.log(f"STOPPING {signame} received: every rank leaves its step; the lowest survivor writes a last "
                 f"checkpoint to {self.checkpoint_dir} (at most {self.preempt_timeout:.0f} s)")
        live = [r for r in self.view.members if r not in self.view.lost]
        if self.view.phase not in ("running", "recovering") or not live:
            self._stop_now(f"{what} ({signame}) before any rank held state to checkpoint.", t)
            return
        self.view.stopping = reason
        if self.view.phase == "running":
            self._signal_actions((policy.AbortGeneration(self.view.generation, tuple(sorted(live))),), reason, t)
        self._preempt_progress(t)

    def _preempt_progress(self, now: float) -> bool:
        """Once every survivor has reported, ask the lowest to checkpoint; past the deadline,
        stop without one. True when the job was stopped."""
        signame, code, deadline = self.preempted
        if now >= deadline:
            self._stop_now(f"{self.view.stopping} No checkpoint was written within {self.preempt_timeout:.0f} s.", now)
            return True
        live = set(self.view.members) - self.view.lost
        if (self.view.phase == "recovering" and live and live <= set(self.view.reports)
                and not self._preempt_asked):
            self._preempt_asked = True
            self._signal_actions((policy.CheckpointNow(min(live), self.view.stopping),), self.view.stopping, now)
        return False

    def _stop_now(self, message: str, t: float) -> None:
        self._signal_actions((policy.Stop(1, message),), message, t)

    def _signal_actions(self, actions, reason: str, t: float) -> None:
        for action in actions:
            self._execute(action, reason, t)
            policy.apply(self.view, action)

    def _form(self, a: policy.FormGeneration, reason: str) -> None:
        now = time.time()
        if a.handoff_from is not None:
            self.log(f"MIGRATE generation {a.gen}: {reason}")
        elif a.gen > 1:
            lost_steps = max(0, self.ledger.max_committed() - a.target)
            if not self.ledger.open:   # a collective failed but nobody died: a transient fault
                rec = FailureRecord(kind="collective error", rank=-1, worker="", step=a.target + 1,
                                    detected_at=now)
                self.ledger.failures.append(rec)
                self.ledger.open.append(rec)
            for f in self.ledger.open:
                if f.generation is None:
                    f.generation, f.reason, f.decided_at = a.gen, reason, now
                    f.recovery_path = "checkpoint" if a.restore else "memory"
                    f.lost_steps = lost_steps
                    f.replacement = a.replacements.get(f.rank)
                    f.source_rank, f.target_step = a.source, a.target
            self.log(f"RECOVER generation {a.gen}: {reason}")
        else:
            self.log(f"START   generation 1: ranks 0-{len(a.members) - 1} on workers "
                     f"{_fmt_ranks(a.members.values())}; {reason}")
        self.progress_at = now
        self.reducing, self.joined, self.committed_in_gen = {}, set(), False
        self.restoring, self._vetted = a.restore, set()
        for m in self.ledger.migrations:
            if m.generation is None:
                if a.handoff_from == m.worker:
                    m.generation, m.target_step, m.lost_steps = a.gen, a.target, 0
                else:
                    m.generation, m.outcome = a.gen, "superseded by a failure"
        extra: dict[str, Any] = {}
        if a.handoff_from is not None:
            # The old worker sends its own state to the spare (a 2-member group), then exits.
            extra = {"join_timeout": max(30.0, 4 * self.join_timeout)}
            rank = next(r for r, w in a.replacements.items())
            self.nodes.send(a.handoff_from, make("handoff", gen=a.gen, rank=rank,
                                                 handoff=f"handoff{a.gen}/", **extra))
        for rank, worker in a.members.items():
            self.nodes.workers[worker].rank = rank
            if self.health is not None:
                self.health.assign(rank, self.nodes.workers[worker].device, worker)
            handoff = ({"handoff": f"handoff{a.gen}/"} if a.handoff_from is not None
                       and a.replacements.get(rank) == worker else {})
            # "moved": state moves to some rank in this generation (every member is told alike:
            # their first vote after it checks the transfer, and a vote is a collective)
            moved = bool(a.receivers or a.restore or a.replacements)
            self.nodes.send(worker, make("generation", gen=a.gen, rank=rank, world=len(a.members),
                                         prefix=f"gen{a.gen}/", target=a.target, source=a.source,
                                         receivers=list(a.receivers), restore=a.restore, moved=moved,
                                         **handoff, **extra))

    def _release_all(self, reason: str) -> None:
        for w in self.nodes.alive():
            if w not in self.view.ready_workers and self.view.rank_of(w) is None:
                self.nodes.kill(w)      # a spare still booting: nothing to wait for
            else:
                self.nodes.send(w, make("release", reason=reason))
