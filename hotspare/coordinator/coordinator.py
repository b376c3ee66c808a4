"""The coordinator: membership, generations, the spare pool and recovery, driven by events.

One thread consumes the event queue in order: typed events (``coordinator.events``) decoded
where they arrived (the node agents' messages, see ``nodes``; the telemetry poller; operator
commands; stop signals). Each one reads as **event -> signal -> decide -> execute -> record**:

- ``handle`` dispatches on the event's type (one table); a worker's message goes through one
  table from its type to a translator (``coordinator.messages``) that keeps the bookkeeping
  (commits, joins) and returns a ``Signal`` for the pure policy, or None;
- ``_signal``: ``policy.observe`` records the signal's facts, ``policy.decide`` returns actions,
  a reason and a reason code, without changing anything;
- the executor (``coordinator.execute``) carries the actions out and ``policy.apply`` records
  their effect on the view; the ledger (``coordinator.ledger``) is the one writer of failure and
  migration records.

Every control message it sends carries the generation, so stale ones are refused. Optional
plug-ins (fault injection for tests, ``hotspare.testing.faults``) attach through ``listen`` and
``command``; without one no such code runs here.
"""
from __future__ import annotations

import dataclasses
import os
import queue
import signal
import sys
import time
from typing import Any, Callable

from hotspare.coordinator import events as ev
from hotspare.coordinator.checkpoints import CheckpointVetter
from hotspare.coordinator.execute import Executor
from hotspare.coordinator.ledger import Ledger
from hotspare.coordinator.messages import WorkerMessages
from hotspare.coordinator.nodes import Nodes, refuse
from hotspare.coordinator.preempt import Preemption
from hotspare.coordinator.progress import Progress
from hotspare.coordinator.trust import check_claims
from hotspare.errors import ConfigError, ProtocolError
from hotspare.policy import decide as policy
from hotspare.policy import hang
from hotspare.policy.phase import JobPhase
from hotspare.policy.signals import describe_exit
from hotspare.protocol.messages import Message, make

PREEMPT_TIMEOUT_S = 20.0   # SIGTERM/SIGINT: time for the last checkpoint (schedulers SIGKILL after ~30 s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorSettings:
    """The coordinator's knobs; ``hotspare run`` builds them from its typed configuration
    (hotspare/config/run.py, in cli/run.py ``_control_plane``)."""
    log_every: int = 0                              # a progress line every K steps (0: ~20 per run)
    hang_floor: float = hang.DEFAULT_FLOOR_S        # hang detection (policy/hang.py)
    hang_factor: float = hang.DEFAULT_FACTOR
    join_timeout: float = 5.0                       # seconds to form a generation's group
    checkpoint_dir: str = "hotspare-checkpoints"    # the only directory workers write checkpoints to
    checkpoint_key: bytes | None = None             # verifies checkpoints before a restore
    preempt_timeout: float = PREEMPT_TIMEOUT_S      # SIGTERM: time allowed for the last checkpoint


class Coordinator:
    def __init__(self, nodes: Nodes, events: "queue.Queue", view: policy.ClusterView, ledger: Ledger,
                 settings: CoordinatorSettings = CoordinatorSettings(), *, log: Callable[[str], None] = print,
                 health=None, plugins=()):
        """``health``: the health desk (coordinator.health.HealthMonitor) or None; ``plugins``:
        objects with ``install(coordinator)`` (fault injection for tests, hotspare.testing.faults)."""
        self.nodes, self.events, self.view, self.ledger = nodes, events, view, ledger
        self.settings = settings
        self.log = log
        log_every, checkpoint_dir = settings.log_every, settings.checkpoint_dir
        self.hang_floor, self.hang_factor = settings.hang_floor, settings.hang_factor
        self.join_timeout = join_timeout = settings.join_timeout
        self.checkpoint_dir = checkpoint_dir
        checkpoint_key = settings.checkpoint_key
        self.preemption = Preemption(view, settings.preempt_timeout, checkpoint_dir, self._signal_actions,
                                     self._stop_now, log)
        self.progress = Progress(at=time.time())
        self.vetter = CheckpointVetter(checkpoint_key, ledger, log)
        self.health = health                    # coordinator.health.HealthMonitor, or None
        if health is not None:
            health.attach(nodes.tell)           # its checks run on the nodes (hotspare.agent.checks)
        self.executor = Executor(nodes, view, ledger, self.progress, self.vetter, log, checkpoint_dir,
                                 join_timeout, health)
        self.debug = bool(os.environ.get("HOTSPARE_DEBUG"))
        self._health_said: set[tuple] = set()
        self._next_tick = 0.0
        # event type -> its handler; plug-ins add listeners, which run after it (``listen``)
        self._events: dict[type, Callable[[Any], None]] = {
            ev.NodeConnected: self._node_connected, ev.NodeLost: self._node_lost,
            ev.NodeResumed: self._node_resumed, ev.NodeReleased: self._node_released,
            ev.AgentRefused: self._agent_refused, ev.DeviceChecked: self._device_checked,
            ev.WorkerStarted: _nothing, ev.WorkerStopped: _nothing,
            ev.WorkerExited: self._worker_exited, ev.WorkerSaid: self._worker_said,
            ev.Readings: self._readings, ev.OperatorCommand: self._command, ev.Preempt: self._preempt,
        }
        self._listeners: dict[type, list[Callable[[Any], None]]] = {}
        self.journal: Callable[[], None] | None = None   # persists the job's state (hotspare.service)
        self.messages = WorkerMessages(nodes, view, ledger, self.progress, self.executor, log, log_every,
                                       checkpoint_dir, health, health_readings=self._health_readings,
                                       stop=self._stop_now)
        self._commands: dict[str, Callable[[Message, str], Message]] = {}   # operator commands
        for plugin in plugins:
            plugin.install(self)

    # ------------------------------------------------------------------ the plug-in seam
    def listen(self, event_type: type, handler: Callable[[Any], None]) -> None:
        """Also call ``handler(event)`` for each event of ``event_type``, after its own handling."""
        self._listeners.setdefault(event_type, []).append(handler)

    def command(self, type_: str, handler: Callable[[Message, str], Message]) -> None:
        """Answer the operator command ``type_`` with ``handler(msg, origin)`` (a ``control_reply``)."""
        self._commands[type_] = handler

    # ------------------------------------------------------------------ life cycle
    @property
    def exit_code(self) -> int | None:
        return self.executor.exit_code

    def start(self, nodes: int = 1, timeout: float = 30.0) -> None:
        """Wait for ``nodes`` node agents to connect, then start the ranks and the spare pool."""
        deadline = time.time() + timeout
        while len(self.nodes.live_nodes()) < nodes:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                raise ConfigError(f"{len(self.nodes.live_nodes())} of {nodes} node agent(s) connected "
                                  f"within {timeout:.0f} s") from None
            self.handle(event)
        while self.health is not None and self.health.admitting:   # the nodes' admission checks
            try:
                self.handle(self.events.get(timeout=1.0))
            except queue.Empty:
                pass
        for rank in range(self.view.world_size):
            if self.nodes.spawn("active", rank=rank) is None:
                raise ConfigError(f"only {len(self.nodes.free_devices())} usable device(s) for "
                                  f"{self.view.world_size} ranks: uncordon devices (hotspare uncordon) or "
                                  "lower --nproc")
        self.executor.spawn_spares(self.view.target_spares)   # the initial pool: not replacements
        self.view.starting += self.view.target_spares

    def finish_checks(self, timeout: float) -> None:
        """Before the agents go: wait at most ``timeout`` seconds for the device checks still
        running on the nodes (a device that passes goes back to the pool for the next job);
        then start no more. Only the picture of the workers is kept current meanwhile."""
        if self.health is None:
            return
        deadline = time.time() + timeout
        while self.health.pending() and time.time() < deadline:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                break
            self._wind_down(event)
        self.health.stop()

    def _wind_down(self, event: ev.Event) -> None:
        """An event while the job winds down: no decision is taken any more."""
        if isinstance(event, ev.NodeReleased):
            self.nodes.lose(event.node)
        elif isinstance(event, ev.NodeLost):
            node = self.nodes.nodes.get(event.node)
            self.nodes.lose(event.node, event.channel)
            if self.health is not None and node is not None and node.channel is event.channel:
                self.health.node_lost(event.node)       # not for a refused second link of its name
        elif isinstance(event, (ev.WorkerExited, ev.WorkerStarted, ev.WorkerStopped)):
            self.nodes.observe(event)
        elif isinstance(event, ev.DeviceChecked):
            self._device_checked(event)

    def stop_nodes(self, grace: float) -> None:
        """Ask every node agent to end its workers (SIGKILL after ``grace`` seconds) and wait
        for the links to close. Only the picture of the workers is kept current meanwhile: no
        decision is taken on a job that is ending."""
        self.nodes.shutdown(grace)
        deadline = time.time() + grace + 5.0
        while self.nodes.live_nodes() and time.time() < deadline:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                break
            self._wind_down(event)
        for name in [n.name for n in self.nodes.live_nodes()]:
            self.log(f"NODE    {name}: its agent did not close its link within {grace + 5.0:.0f} s")

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
            event = self.events.get(timeout=max(0.0, self._next_tick - time.time()))
        except queue.Empty:
            event = None
        if event is not None:
            self.handle(event)
        now = time.time()
        if now >= self._next_tick:
            limit = hang.threshold(self.ledger.step_times, self.hang_floor, self.hang_factor)
            self._next_tick = now + (poll if poll is not None else hang.tick_period(limit))
            self._tick(now, limit)

    def over(self) -> bool:
        return self.view.phase.over and not self.nodes.alive()

    # ------------------------------------------------------------------ events
    def handle(self, event: ev.Event) -> None:
        """One event, in queue order."""
        if self.debug and not (isinstance(event, ev.WorkerSaid) and event.type in ("step", "commit")):
            self.log(f"debug   event {event}")
        if isinstance(event, ev.WORKER_EVENTS):
            worker = self.nodes.workers.get(event.worker)
            if isinstance(event, ev.WorkerSaid) and worker is not None:
                try:
                    check_claims(event.msg, worker.rank, self.view.generation, self.view.world_size)
                except ProtocolError as e:
                    _say(f"refusing a message from worker {event.worker}: {e}", flush=True)
                    return
            if isinstance(event, ev.WorkerExited) and worker is not None and worker.exit_code is not None:
                return          # already handled: an exit replayed after the node resumed, say
            if self.nodes.observe(event) is None:
                _say(f"ignoring {type(event).__name__} about unknown worker {event.worker!r}")
                return
        handler, listeners = self._events.get(type(event)), self._listeners.get(type(event), ())
        if handler is None and not listeners:
            _say(f"ignoring {type(event).__name__}: nothing in this job handles it (a plug-in not loaded)")
            return
        if handler is not None:
            handler(event)
        for listener in listeners:
            listener(event)

    def _node_connected(self, e: ev.NodeConnected) -> None:
        back = e.node in self.nodes.detached()     # after a restart: an agent it knew re-registers
        try:
            node = self.nodes.add(e.hello, e.channel)
        except ProtocolError as err:
            self.log(f"NODE    refused an agent: {err}")
            refuse(e.channel, "agent_hello", str(err))
            return
        slots = f"{len(node.devices)} device slot(s)" if node.devices else "no device slots"
        self.log(f"NODE    {e.node}: agent pid {node.pid} " + ("re-registered" if back else f"connected, {slots}"))
        if self.health is None:
            return
        if back:
            ranks = {r: wp.device for r, w in self.view.members.items()
                     if (wp := self.nodes.workers[w]).node == node.name and wp.device is not None}
            self.health.node_resumed(node.name, node.devices, ranks)
        else:
            self.health.node_connected(node.name, node.devices)

    def _node_resumed(self, e: ev.NodeResumed) -> None:
        """A node's agent re-registered after this coordinator restarted and replayed what its
        workers said and did meanwhile; a worker it no longer runs whose exit was not among
        that (more than the agent could keep) is gone all the same."""
        node = self.nodes.nodes.get(e.node)
        if node is None or node.lost:
            return
        gone = [w for w in sorted(node.missing) if self.nodes.workers[w].exit_code is None]
        node.missing = set()
        self.log(f"NODE    {e.node}: resumed, {len(e.alive)} worker(s) still running")
        for w in gone:
            self.nodes.workers[w].exit_code = -signal.SIGKILL
            self._worker_gone(w, -signal.SIGKILL, "ended while the coordinator was away", e.t)

    def _node_released(self, e: ev.NodeReleased) -> None:
        """A node's agent ended its part of this job while it still ran: its workers are lost."""
        node = self.nodes.nodes.get(e.node)
        if node is not None and node.channel is not None:
            self._node_lost(ev.NodeLost(e.node, node.channel, e.t))

    def _device_checked(self, e: ev.DeviceChecked) -> None:
        if self.health is not None:
            self.health.checked(e)

    def _agent_refused(self, e: ev.AgentRefused) -> None:
        self.log(f"NODE    {e.node} refused {e.command!r}: {e.message}")

    def _node_lost(self, e: ev.NodeLost) -> None:
        if e.node in self.nodes.nodes and self.nodes.nodes[e.node].channel is not e.channel:
            return                  # a link refused above
        lost = self.nodes.lose(e.node, e.channel)
        if self.health is not None:
            self.health.node_lost(e.node)
        if lost or not self.view.phase.over:
            self.log(f"NODE    {e.node}: the link to its agent closed; {len(lost)} worker(s) lost with it")
        for w in lost:
            self.nodes.workers[w].exit_code = -signal.SIGKILL
            self._worker_gone(w, -signal.SIGKILL, f"was lost with node {e.node}", e.t, node_lost=True)

    def _worker_exited(self, e: ev.WorkerExited) -> None:
        desc = describe_exit(e.code)
        if e.worker in self.ledger.fences:   # (it may die of something else writing its stacks first)
            desc = "was fenced (SIGKILL" + ("" if e.code == -signal.SIGKILL else f"; it {desc} first") + ")"
        self._worker_gone(e.worker, e.code, desc, e.t)

    def _worker_gone(self, worker: str, code: int, desc: str, t: float, node_lost: bool = False) -> None:
        wp = self.nodes.workers[worker]
        if (wp.role == "spare" and worker not in self.view.ready_workers and code < 0
                and not self.view.phase.over):
            self.log(f"SPARE   {worker} {desc} while it started; another spare takes its place")
        restoring, rank = self.progress.restoring, self.view.rank_of(worker)
        if (restoring and code > 0 and not self.progress.committed and rank is not None
                and self.vetter.restore_failed(restoring)):
            # It ended on its own before the restored generation committed: it could not load it.
            self.log(f"CHECKPOINT {restoring}: rank {rank} ({worker}) {desc} while "
                     "restoring it (see its output above); it will not be tried again")
        self._member_lost(worker, desc, code, t, node_lost)
        self._signal(policy.WorkerExited(worker, code, desc, node_lost, spare=wp.role == "spare"), t)
        if self.health is not None:
            self.health.device_released(wp.device)

    def _member_lost(self, worker: str, desc: str, code: int, t: float, node_lost: bool) -> None:
        rank = self.view.rank_of(worker)
        if rank is None or not self.view.phase.active or rank in self.view.done:
            return
        wp = self.nodes.workers[worker]
        crash = next((c for c in reversed(self.view.crashes) if c.worker == worker), None)
        rec = self.ledger.member_lost(rank, worker, code, t, wp.last_step, crash.error if crash else None,
                                      node_lost, spare_was_warm=bool(self.view.ready_spares))
        latency = f"; detected in {(rec.detected_at - rec.fault_at) * 1000:.0f} ms" if rec.fault_at else ""
        self.log(f"FAILED  rank {rank} ({self.executor.where(worker)}, pid {wp.pid}) {desc} at step "
                 f"{rec.step}{latency}")

    def _tick(self, now: float, limit: float) -> None:
        """``limit``: the hang threshold for the steps seen so far (``policy.hang.threshold``)."""
        if not self.view.phase.active:
            return
        if self.preemption.active and self.preemption.progress(now):
            return
        if self.health is not None:
            self.health.poll_operator(now, lambda v, first: self._act_on(v, now, "registry", record=first))
        self.executor.place_waiting()
        activity = tuple(
            hang.RankActivity(r, self.nodes.workers[w].last_step, self.progress.reducing.get(r),
                              self.nodes.workers[w].stopped)
            for r, w in sorted(self.view.members.items()) if r not in self.view.lost)
        limit = hang.lenient(limit, self.join_timeout, recovering=self.view.phase is JobPhase.RECOVERING,
                             forming=len(self.progress.joined) < len(self.view.members) or not self.progress.committed)
        since = 0.0 if self.progress.recovering_since is None else now - self.progress.recovering_since
        self._probe(now, now - self.progress.at, limit)
        self._signal(policy.Tick(activity, now - self.progress.at, since, limit), now)

    def _probe(self, now: float, stalled: float, limit: float) -> None:
        """Past half the hang threshold, ask every rank (again every tenth of it) which step's
        gradient exchange it entered last; the answers ("reducing") reach the hang detector
        before the threshold. A rank that cannot answer keeps its older answer: it is behind."""
        if (self.view.phase is not JobPhase.RUNNING or stalled < limit / 2
                or now - self.progress.probed_at < max(0.2, limit / 10)):
            return
        self.progress.probed_at = now
        for r, w in self.view.members.items():
            if r not in self.view.lost:
                self.nodes.send(w, make("probe", gen=self.view.generation))

    # ------------------------------------------------------------------ a worker's messages
    def _worker_said(self, e: ev.WorkerSaid) -> None:
        try:
            sig = self.messages.translate(e.worker, e.msg, e.t)
        except (KeyError, TypeError, ValueError, AttributeError, ProtocolError) as err:
            # Well-formed by the schema yet unusable here: refused, the job goes on.
            _say(f"ignoring bad message from {e.worker}: {type(err).__name__}: {err}")
            return
        if sig is not None:
            self._signal(sig, e.t)

    # ------------------------------------------------------------------ signal -> decide -> execute
    def _signal(self, sig: policy.Signal, t: float) -> policy.Decision:
        self.view.job_step = self.ledger.max_committed()
        policy.observe(self.view, sig)
        stop = self.vetter.vet(self.view)   # with this signal's facts, before the policy may order a restore
        if stop is not None:
            self._stop_now(stop, time.time())
        decision = policy.decide(self.view, sig, t)
        if self.debug and not (isinstance(sig, policy.Tick) and not decision.actions):
            self.log(f"debug   decide {type(sig).__name__} phase={self.view.phase} -> {decision}")
        self._signal_actions(decision.actions, decision.reason, t)
        return decision

    def _signal_actions(self, actions, reason: str, t: float) -> None:
        # With a journal (the coordinator service's database), the state after the actions is
        # written before any command they make leaves: a restarted coordinator never misses a
        # decision an agent acted on (``resume`` sends its orders again, workers drop repeats).
        journaled = self.journal is not None and bool(actions)
        if journaled:
            self.nodes.hold()
        for action in actions:
            self.executor.execute(action, reason, t)
            policy.apply(self.view, action)
        if journaled:
            self.journal()
            self.nodes.flush()
        if self.view.phase is JobPhase.RECOVERING and self.progress.recovering_since is None:
            self.progress.recovering_since = t
        elif self.view.phase is not JobPhase.RECOVERING:
            self.progress.recovering_since = None

    def resume(self) -> None:
        """After a restart, once the nodes re-registered and replayed what they saw: repeat
        the orders of the current generation (a worker drops an order it already took), or,
        for a job that was ending, its release or stop."""
        if self.view.phase.over:
            for w in self.nodes.alive():
                if self.view.phase is JobPhase.FINISHED:
                    self.nodes.send(w, make("release", reason="training complete"))
                else:
                    self.nodes.kill(w)
            return
        for worker in [*self.view.members.values(), *([self.view.migrating.spare] if self.view.migrating else [])]:
            order = self.nodes.orders.get(worker)
            if order is not None and order["gen"] == self.view.generation:
                self.nodes.send(worker, order)
        for worker, order in self.nodes.orders.items():     # a migrating rank's hand-off
            if order["type"] == "handoff" and order["gen"] == self.view.generation:
                self.nodes.send(worker, order)

    def stop(self, message: str) -> None:
        """End the job now (its workers are ended), for ``message`` (an operator's cancel)."""
        if not self.view.phase.over:
            self._stop_now(message, time.time())

    def _stop_now(self, message: str, t: float) -> None:
        self._signal_actions((policy.Stop(1, message),), message, t)

    # ------------------------------------------------------------------ operators, stop signals
    def _command(self, e: ev.OperatorCommand) -> None:
        """An operator command from the control endpoint (authenticated; ``origin`` says by
        whom, from where); a bad one changes nothing, and is logged too."""
        if self.view.phase.over:
            e.reply(make("control_reply", ok=False, message=f"the job has {self.view.phase}"))
            return
        handler = self._commands.get(e.msg["type"])
        if handler is None:
            self.log(f"OPERATOR refused {e.msg['type']} from {e.origin}: this job was started without "
                     "--allow-inject")
            e.reply(make("control_reply", ok=False, message=f"this job takes no {e.msg['type']!r} commands: it "
                         "was started without --allow-inject (or --inject); start it with "
                         "`hotspare run --allow-inject ...` to arm faults while it runs"))
            return
        e.reply(handler(e.msg, e.origin))

    def _preempt(self, e: ev.Preempt) -> None:
        """SIGTERM or SIGINT to the launcher: stop after a last checkpoint (``preempt``)."""
        if self.view.phase.over or self.preemption.active:
            return
        self.executor.preempt_code = e.code      # the job's stop, whichever way, is a preemption
        self.preemption.start(e.signal, e.code, e.t)

    # ------------------------------------------------------------------ health
    def _readings(self, e: ev.Readings) -> None:
        """A telemetry poll: the launcher's (queued by its poller thread) or a remote node's."""
        if self.health is None:
            return                              # telemetry is off in this job
        readings = e.readings if e.node is None else self.health.node_readings(e.node, e.readings, e.t)
        if readings:
            self.health.record_readings(readings, e.t)
            self._health_readings(readings, e.t)

    def _health_readings(self, readings, t: float, step: int | None = None) -> None:
        for reading in readings:
            verdict = self.health.observe(reading, t)
            if verdict is not None:
                self._act_on(verdict, t, reading.source, step)

    def _act_on(self, verdict, t: float, source: str, step: int | None = None,
                record: bool = True) -> policy.Decision | None:
        """A verdict becomes a signal for the pure policy, like any failure (``record``: in the
        report's health events; a drain asked for again is recorded once)."""
        if self.view.phase.over:
            return None
        worker = self.view.members.get(verdict.rank, "") if verdict.rank is not None else ""
        if record:
            self.ledger.health_events.append({
                "time": round(t - self.ledger.started, 3), "device": verdict.device, "rank": verdict.rank,
                "action": verdict.action, "rule": verdict.rule, "reason": verdict.reason,
                "trust_memory": verdict.trust_memory, "source": source})
        decision = self._signal(policy.HealthVerdict(verdict.device, verdict.rank, verdict.action,
                                                     verdict.reason, verdict.trust_memory, verdict.rule,
                                                     step, worker), t)
        said = (verdict.device, decision.code, verdict.action, verdict.rank)
        if not decision.actions and said not in self._health_said:   # e.g. no spare to move to
            self._health_said.add(said)
            self.log(f"HEALTH  {decision.reason}")
        return decision


def _nothing(event: ev.Event) -> None:
    """Events that only keep the picture of the workers current (``Nodes.observe``, in ``handle``)."""


def _say(line: str, flush: bool = False) -> None:
    print(f"hotspare: {line}", file=sys.stderr, flush=flush)
