"""The coordinator's health desk: readings in, verdicts out, device lifecycle kept.

Readings come from two places and meet the same rules:

* the node's telemetry source (NVML on GPUs, the simulated source on CPU), polled in a thread
  and queued to the coordinator's event loop like any other event;
* the training runtime: per-step compute/exchange times (from which the straggler score is
  computed here, across ranks) and the per-step health vote (fingerprint mismatch, NaN/Inf).

``observe`` runs the rules on one device's history window and the fleet policies (circuit
breaker, repeat offender) on the result; the coordinator turns a verdict into a
``policy.HealthVerdict`` signal, so health actions go through the same pure ``decide`` as
failover. The device lifecycle (healthy → cordoned → draining → quarantined → healthy/retired) is
kept in the registry. Admission and quarantine diagnostics run on the node that holds the device,
as its agent's commands (``admit``, ``diagnose``: ``hotspare.agent.checks``); their verdicts come
back as events. A remote host's devices (``adopt``) join the desk as its agent connects, named
``NODE/...``; their telemetry is polled by that agent and arrives as its ``readings``
(``hotspare.agent.telemetry``), their reset before diagnostics is done there too. Nothing here
imports torch.
"""
from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from typing import Any, Callable

from hotspare.coordinator.events import DeviceChecked
from hotspare.health import types as T
from hotspare.health.lifecycle import State
from hotspare.health.registry import Registry, RegistryError
from hotspare.health.rules import FleetState, RuleSet, apply_fleet_policies, evaluate, worst
from hotspare.health.types import Reading, Verdict
from hotspare.policy.actions import Pause
from hotspare.protocol.messages import Message, make

EVENT_METRICS = (T.FINGERPRINT_MISMATCH, T.NONFINITE)   # one-off runtime events
STRAGGLER_WINDOW = 10      # steps of compute time per rank behind one straggler score
OPERATOR_POLL_S = 1.0      # operator commands are looked for in the registry this often
RECORD_EVERY_S = 5.0       # readings reach the registry at most this often: one write (a whole file) for every node's polls


class HealthMonitor:
    def __init__(self, rules: RuleSet, registry: Registry, devices: list[str],
                 log: Callable[[str], None] = print,
                 poll: Callable[[], list[Reading]] | None = None,
                 reset: Callable[[str], None] | None = None, diagnostics_passes: int = 2,
                 size: str = "small", admission: str = "off", adopt: bool = False):
        """``poll()``: the telemetry source's readings now; a quarantined device's telemetry
        must be clean again before each diagnostics pass. ``reset(device)``: what a GPU reset
        does, before the first pass. The checks themselves run on the node that holds the
        device (``hotspare.agent.checks``): commands go down through ``attach``'s ``tell``,
        verdicts come back as ``DeviceChecked`` events (``checked``). ``admission``: "off", or
        the size of the admission checks a node's devices pass before they take work.
        ``adopt``: devices a node names in its hello that are not in ``devices`` join the desk
        when they are named after that node (``NODE/cpu0``): a remote host's, whose telemetry
        its own agent polls and sends (``node_readings``)."""
        self.rules, self.registry, self.devices, self.log = rules, registry, list(devices), log
        self.history: dict[str, list[Reading]] = {}
        self.rank_device: dict[int, str] = {}
        self.compute: dict[int, collections.deque] = {}
        self.window_median: dict[int, float] = {}
        self.remediations: list[tuple[float, str]] = []
        self.poll, self.reset, self.passes, self.size, self.admission = poll, reset, diagnostics_passes, size, admission
        self.diagnosing: dict[str, int] = {}      # device -> diagnostics passes it passed so far
        self.admitting: set[str] = set()
        self.retiring: set[str] = set()
        self.owner: dict[str, str] = {}           # device -> the node that holds it
        self.adopt = adopt
        self.remote: set[str] = set()             # devices whose telemetry their node's agent sends
        self._asked: dict[str, float] = {}        # remote device -> when its diagnostics pass was asked
        self._fresh: dict[str, tuple[float, Reading]] = {}   # remote device -> (arrival, its newest reading)
        self._reset_next: set[str] = set()        # remote devices whose next pass starts with a reset
        self._refused: set[tuple[str, str]] = set()
        self._unrecorded: dict[tuple[str, str], Reading] = {}   # (device, source) -> newest, not yet written
        self._recorded_at = 0.0
        self._tell: Callable[[str, Message], bool] | None = None
        self._stopping = False    # the job is stopping: start no diagnostics (running ones answer)
        self._revision = 0         # the registry's revision last seen (operator commands)
        self._operator_polled = 0.0
        self._drains: dict[str, str] = {}          # device the operator drained -> the reason
        self._draining_off: dict[str, int] = {}    # drained device -> the rank whose move off it was ordered
        self._drain_said: set[tuple[str, int]] = set()
        self._said: dict[str, str] = {}
        for d in self.devices:
            self.registry.ensure(d)
            for t, _ in ((x, d) for x in self.registry.get(d).remediations):
                self.remediations.append((t, d))
        self._revision = self.registry.revision()

    def attach(self, tell: Callable[[str, Message], bool]) -> None:
        """``tell(node, command)`` sends a command to a node's agent (``Nodes.tell``)."""
        self._tell = tell

    def pending(self) -> bool:
        """Is a check running on a node that the desk waits for?"""
        return bool(self.diagnosing or self.admitting)

    def node_connected(self, node: str, devices: list[str]) -> None:
        """A node's agent connected: its devices pass admission (when asked for); a device a
        job left quarantined mid-diagnostics is diagnosed again."""
        if self.adopt:
            self._adopt(node, devices)
        mine = []
        for d in devices:
            if d not in self.devices:
                continue
            if self.owner.get(d, node) != node:
                self.log(f"HEALTH  node {node} names {d}, which node {self.owner[d]} holds: not watched for it")
                continue
            self.owner[d] = node
            mine.append(d)
        fresh = [d for d in mine if self.registry.get(d).state != State.QUARANTINED]
        if self.admission != "off" and fresh:
            kinds = sorted({"gpu" if "/gpu" in d else "cpu" for d in fresh})
            self.log(f"ADMISSION {len(fresh)} {'/'.join(kinds)} device(s), size {self.admission}")
            for kind in kinds:       # one device group per kind
                group = [d for d in fresh if ("/gpu" in d) == (kind == "gpu")]
                self.admitting.update(group)
                if not self._command(node, make("admit", devices=group, size=self.admission)):
                    self.admitting.difference_update(group)
                    self.log(f"ADMISSION {', '.join(group)}: node {node} is gone; not admitted")
        for d in mine:
            if self.registry.get(d).state == State.QUARANTINED:
                self._start_diagnostics(d)

    def node_resumed(self, node: str, devices: list[str], ranks: dict[int, str]) -> None:
        """After the coordinator restarted, the agent of a node it knew re-registered: its
        devices are watched again (no admission: they are at work), ``ranks`` (rank -> device)
        run there, and a quarantined device is diagnosed again from its first pass (a pass in
        flight when the coordinator went is not waited for)."""
        if self.adopt:
            self._adopt(node, devices)
        mine = [d for d in devices if d in self.devices and self.owner.setdefault(d, node) == node]
        for rank, device in ranks.items():
            if device in mine:
                self.rank_device[rank] = device
        for d in mine:
            if self.registry.get(d).state == State.QUARANTINED:
                self._start_diagnostics(d)

    def _adopt(self, node: str, devices: list[str]) -> None:
        """A remote node's devices join the desk (the launcher's registry keeps their record)."""
        new = [d for d in devices if d not in self.devices and d.split("/", 1)[0] == node]
        for d in devices:
            if d not in self.devices and d not in new:
                self.log(f"HEALTH  node {node} names device {d[:64]!r}, not one of its own (NODE/...): not watched")
        for d in new:
            rec = self.registry.ensure(d)
            self.remediations.extend((t, d) for t in rec.remediations)
            self.devices.append(d)
            self.remote.add(d)
        if new:
            self.log(f"HEALTH  node {node}: {len(new)} device(s) watched, telemetry from its agent: {', '.join(new)}")

    def node_readings(self, node: str, readings: list[Reading], now: float) -> list[Reading]:
        """A remote node's poll: the readings of its own watched devices (others are dropped
        and said once); the newest of each is kept for its diagnostics' telemetry check."""
        out = []
        for r in readings:
            if r.device in self.remote and self.owner.get(r.device) == node:
                out.append(r)
                self._fresh[r.device] = (now, r)
            elif (node, r.device) not in self._refused:
                self._refused.add((node, r.device))
                self.log(f"HEALTH  ignoring node {node}'s readings of {r.device}: not a device it holds here")
        return out

    def node_lost(self, node: str) -> None:
        """The link to ``node`` closed: its checks will not answer."""
        for d in [d for d, n in self.owner.items() if n == node]:
            del self.owner[d]
            if d in self.diagnosing:
                del self.diagnosing[d]
                self.log(f"QUARANTINE {d}: node {node} is gone mid-diagnostics; the device stays quarantined "
                         f"and the next job on this node diagnoses it again")
            self.admitting.discard(d)

    def stop(self) -> None:
        """The job is stopping: no more diagnostics start (those running still answer); the
        readings kept are written."""
        self._stopping = True
        self.flush_readings()

    # ------------------------------------------------------------------ devices
    def usable(self, device: str) -> bool:
        """May a new worker start on ``device``? (healthy or merely suspect)."""
        if device in self.admitting:
            return False
        rec = self.registry.find(device)
        return rec is None or rec.state in (State.HEALTHY, State.SUSPECT)

    def assign(self, rank: int | None, device: str | None, worker: str = "") -> None:
        if device is None:
            return
        if rank is not None:
            for r, d in list(self.rank_device.items()):
                if d == device or r == rank:
                    del self.rank_device[r]
            self.rank_device[rank] = device
            self.compute.pop(rank, None)
            self.window_median.pop(rank, None)
        self.registry.assign(device, rank, job=worker or None)

    def rank_on(self, device: str) -> int | None:
        return next((r for r, d in self.rank_device.items() if d == device), None)

    # ------------------------------------------------------------------ readings -> verdicts
    def observe(self, reading: Reading, now: float | None = None) -> Verdict | None:
        """Add one reading to its device's window; return the verdict to act on, if any."""
        now = time.time() if now is None else now
        dev = reading.device
        hist = self.rules.trim(self.history.get(dev, []) + [reading], now)
        self.history[dev] = hist
        verdict = worst(evaluate(self.rules, hist, now, touched=reading.metrics))
        events = {m: False for m in EVENT_METRICS if reading.metrics.get(m)}
        if events:   # a vote is an event, not a state: the next reading must not find it again
            hist.append(Reading(dev, reading.time, reading.source, events, reading.rank))
        if verdict is None or verdict.action == T.IGNORE:
            return None
        verdict = apply_fleet_policies([verdict], FleetState(len(self.devices), tuple(self.remediations)),
                                       now, self.rules.policy)[0]
        # The rank on the device *now*: an old reading must never condemn the rank that replaced it.
        verdict = _with_rank(verdict, self.rank_on(dev))
        said = f"{verdict.action}:{verdict.rule}"
        if self._said.get(dev) != said:          # say each new verdict once, not every poll
            self._said[dev] = said
            self.log(f"HEALTH  {dev}{'' if verdict.rank is None else f' (rank {verdict.rank})'}: "
                     f"{verdict.action} by rule {verdict.rule}: {verdict.reason}")
        if verdict.action == T.WATCH:
            if self.registry.get(dev).state == State.HEALTHY:
                self.registry.transition(dev, State.SUSPECT, reason=verdict.reason, actor=f"rule:{verdict.rule}")
            return None
        rec = self.registry.get(dev)
        if rec.state not in (State.HEALTHY, State.SUSPECT) and verdict.rank is None:
            return None                          # already out of service and nothing runs there
        return verdict

    def record_readings(self, readings: list[Reading], now: float | None = None) -> None:
        """Keep each device's newest reading per source for the registry, written at most every
        RECORD_EVERY_S: with many nodes each sending its own polls, one registry write (a whole
        file) per poll of each would grow with the fleet."""
        now = time.time() if now is None else now
        for r in readings:
            self._unrecorded.pop((r.device, r.source), None)
            self._unrecorded[(r.device, r.source)] = r
        if now - self._recorded_at >= RECORD_EVERY_S:
            self.flush_readings(now)

    def flush_readings(self, now: float | None = None) -> None:
        """Write the readings kept since the last write (also when the job stops)."""
        if not self._unrecorded:
            return
        pending, self._unrecorded = list(self._unrecorded.values()), {}
        self._recorded_at = time.time() if now is None else now
        try:
            self.registry.record_readings(pending)
        except Exception as e:  # noqa: BLE001 - bookkeeping must never stop the job
            self.log(f"health: could not record readings: {e}")

    def step_timing(self, rank: int, compute: float, comm: float, t: float) -> list[Reading]:
        """Per-step compute time of one rank -> its straggler score against its peers.

        Each rank's compute times are taken in windows of STRAGGLER_WINDOW steps; at the end of
        a window, score = median of the peers' window minimums / this rank's (1.0 typical, < 1
        slower). The minimum, not the mean: contention from neighbours only ever adds time, so
        the fastest step of a window is the device's own speed (on this 2-core machine window
        medians swing 2-5x between windows; minimums stay within ~15%). One reading per window,
        so the rules' ``held = N`` means N windows in a row."""
        window = self.compute.setdefault(rank, collections.deque(maxlen=STRAGGLER_WINDOW))
        window.append(compute)
        dev = self.rank_device.get(rank)
        if dev is None or len(window) < STRAGGLER_WINDOW:
            return []
        mine = min(window)
        window.clear()
        self.window_median[rank] = mine
        peers = [m for r, m in self.window_median.items() if r != rank and r in self.rank_device]
        if not peers or mine <= 0:
            return []
        score = statistics.median(peers) / mine
        return [Reading(dev, t, "runtime", {T.STEP_COMPUTE_S: round(mine, 6), T.STEP_COMM_S: comm,
                                            T.STRAGGLER_SCORE: round(score, 4)}, rank=rank)]

    def vote_readings(self, health: dict, t: float) -> list[Reading]:
        """The runtime's failed health vote -> one reading per suspect rank's device."""
        metric = T.FINGERPRINT_MISMATCH if health.get("kind") == "fingerprint" else T.NONFINITE
        out = []
        for rank in health.get("suspects", []):
            dev = self.rank_device.get(rank)
            if dev is not None:
                out.append(Reading(dev, t, "runtime", {metric: True}, rank=rank))
        return out

    def operator_requests(self, now: float | None = None) -> list[Verdict]:
        """Operator commands given while the job runs (``hotspare drain DEVICE``): a drained
        device whose rank still runs there gets that rank live-migrated off it. (A cordon alone
        only stops new work, as in Kubernetes.) A drain is asked for again at every poll until
        its migration was ordered (``poll_operator``), its device holds no rank any more, or
        the operator took it back: one that arrives while the job cannot move a rank (forming,
        recovering, another migration on its way) is carried out once it can, and one whose
        migration is on its way is never asked for twice. With ``now``: at most once every
        ``OPERATOR_POLL_S``, and a registry that cannot be read this time is said and skipped."""
        if now is not None:
            if now - self._operator_polled < OPERATOR_POLL_S:
                return []
            self._operator_polled = now
            try:
                return self.operator_requests()
            except RegistryError as e:          # e.g. out of file descriptors for a moment
                self.log(f"HEALTH  operator commands not read this time: {e}")
                return []
        self._revision, changed = self.registry.changed_since(self._revision)
        for rec in changed:
            if rec.device not in self.devices:
                continue
            if rec.state == State.DRAINING and rec.actor == "operator":
                self._drains.setdefault(rec.device, rec.reason)
            else:
                self._drains.pop(rec.device, None)
                self._draining_off.pop(rec.device, None)
        out = []
        for device, reason in sorted(self._drains.items()):
            rank = self.rank_on(device)
            if rank is None:                    # moved off (or never ran there): done
                self._drains.pop(device)
                self._draining_off.pop(device, None)
            elif self._draining_off.get(device) != rank:
                out.append(Verdict(device, T.MIGRATE, "operator-drain", f"drained by the operator: {reason}",
                                   True, rank))
        return out

    def poll_operator(self, now: float, act: Callable[[Verdict, bool], Any]) -> None:
        """``operator_requests`` carried out: ``act(verdict, first)`` signals the policy (``first``:
        asked for the first time, said in the log) and returns its decision; once that orders
        the migration, the drain is not asked for again while its rank is on the device (a
        failed migration's rank is recovered elsewhere anyway)."""
        for v in self.operator_requests(now):
            first = (v.device, v.rank) not in self._drain_said
            if first:
                self._drain_said.add((v.device, v.rank))
                self.log(f"OPERATOR {v.device}: {v.reason}")
            decision = act(v, first)
            if decision is not None and any(isinstance(a, Pause) for a in decision.actions):
                self._draining_off[v.device] = v.rank

    # ------------------------------------------------------------------ lifecycle
    def cordon(self, device: str, reason: str, rule: str, now: float, retire: bool = False) -> None:
        """A rule took the device out of service (counted as a remediation by the registry)."""
        rec = self.registry.get(device)
        if retire:
            self.retiring.add(device)
        if rec.state in (State.HEALTHY, State.SUSPECT):
            self.registry.cordon(device, reason, actor=f"rule:{rule or 'health'}")
            self.remediations.append((now, device))
            self.log(f"CORDON  {device}: no new work; {reason}")

    def device_released(self, device: str | None) -> None:
        """The worker on ``device`` exited: a cordoned device drains, then goes to quarantine."""
        if device is None:
            return
        for r, d in list(self.rank_device.items()):
            if d == device:
                del self.rank_device[r]
        rec = self.registry.find(device)
        if rec is None:
            return
        self.registry.release(device)
        actor = "rule:lifecycle"
        if rec.state == State.CORDONED:
            self.registry.drain(device, "its worker left", actor=actor)
            rec = self.registry.get(device)
        if rec.state == State.DRAINING:
            self.registry.quarantine(device, "drained: quarantine diagnostics", actor=actor)
            if device in self.retiring:
                self.registry.retire(device, "repeat offender: retired for repair (RMA)", actor=actor)
                self.log(f"RETIRE  {device}: repeat offender, out of service for good")
                return
            self._start_diagnostics(device)

    def _start_diagnostics(self, device: str) -> None:
        if device in self.diagnosing or device not in self.owner:   # not connected: when it does
            return
        if self._stopping:
            self.log(f"QUARANTINE {device}: the job is stopping; diagnostics not started (the device "
                     f"stays quarantined; the next job on this node diagnoses it)")
            return
        if device in self.remote:
            self._reset_next.add(device)         # reset on its node, by its agent, with the first pass
        elif self.reset is not None:
            try:
                self.reset(device)               # e.g. a GPU reset; the simulated device resets
            except Exception as e:  # noqa: BLE001
                self.log(f"QUARANTINE {device}: the reset failed ({e}); diagnostics go on")
        self.diagnosing[device] = 0
        self.log(f"QUARANTINE {device}: drained; diagnostics started on node {self.owner[device]} (burn-in, "
                 f"memory patterns; back in the pool after {self.passes} passes)")
        self._next_pass(device)

    def _next_pass(self, device: str) -> None:
        """Telemetry first (clean again after the reset), then the node's checks. A remote
        device's agent resets it (first pass) and sends a fresh poll before its checks start;
        that reading is judged when the verdict comes (``_remote_telemetry``)."""
        remote = device in self.remote
        bad = None if remote else self._telemetry_trips(device)
        if bad is not None:
            self._failed(device, f"telemetry still trips {bad.rule}: {bad.reason}")
            return
        node = self.owner.get(device)
        cmd = make("diagnose", device=device, size=self.size)
        if remote:
            cmd["reset"] = device in self._reset_next
            self._reset_next.discard(device)
            self._asked[device] = time.time()
        if node is None or not self._command(node, cmd):
            del self.diagnosing[device]
            self.log(f"QUARANTINE {device}: diagnostics could not run: its node is gone; it stays quarantined")

    def _remote_telemetry(self, device: str) -> str | None:
        """Why a remote device's pass cannot count on its telemetry (None: clean): its agent
        sends a poll before each pass's checks start, so one must have arrived since it was asked."""
        fresh, asked = self._fresh.get(device), self._asked.get(device, 0.0)
        if fresh is None or fresh[0] < asked:
            return f"no telemetry reading from node {self.owner.get(device)} came with the pass"
        bad = [v for v in evaluate(self.rules, [fresh[1]], time.time()) if T.SEVERITY[v.action] > T.SEVERITY[T.WATCH]]
        if bad:
            v = worst(bad)
            return f"telemetry still trips {v.rule}: {v.reason}"
        return None

    def _telemetry_trips(self, device: str) -> Verdict | None:
        if self.poll is None:
            return None
        now = time.time()
        readings = [r for r in self.poll() if r.device == device]
        bad = [v for v in evaluate(self.rules, readings, now) if T.SEVERITY[v.action] > T.SEVERITY[T.WATCH]]
        return worst(bad) if bad else None

    def _command(self, node: str, msg: Message) -> bool:
        return self._tell is not None and self._tell(node, msg)

    def _failed(self, device: str, detail: str) -> None:
        del self.diagnosing[device]
        self.registry.diagnostics_failed(device, detail)
        self.log(f"QUARANTINE {device}: diagnostics failed ({detail}): {self.registry.get(device).state.value}")

    def checked(self, e: DeviceChecked) -> None:
        """A node's verdict on one of its devices (admission, or one diagnostics pass)."""
        if self.owner.get(e.device) != e.node:
            self.log(f"HEALTH  ignoring node {e.node}'s {e.stage} verdict on {e.device}: not its device")
            return
        if e.stage == "admission":
            self._admitted(e)
        elif e.device not in self.diagnosing:
            self.log(f"HEALTH  ignoring node {e.node}'s diagnostics of {e.device}: none were asked for")
        elif e.cancelled:
            del self.diagnosing[e.device]
            self.log(f"QUARANTINE {e.device}: diagnostics cut short, the job is stopping; the device stays "
                     f"quarantined and the next job on this node diagnoses it again")
        elif not e.passed:
            self._failed(e.device, e.detail)
        elif e.device in self.remote and (why := self._remote_telemetry(e.device)) is not None:
            self._failed(e.device, why)
        else:
            done = self.diagnosing[e.device] + 1
            self.diagnosing[e.device] = done
            rec = self.registry.diagnostics_passed(e.device, e.detail)
            self.log(f"QUARANTINE {e.device}: diagnostics pass {done}/{self.passes} on node {e.node}: {e.detail}")
            if rec.state == State.HEALTHY:
                del self.diagnosing[e.device]
                self.history.pop(e.device, None)
                self._said.pop(e.device, None)
                self.log(f"HEALTHY {e.device}: back in the pool after {done} passing diagnostics")
            elif done >= self.passes:
                del self.diagnosing[e.device]
            else:
                self._next_pass(e.device)

    def _admitted(self, e: DeviceChecked) -> None:
        if e.device not in self.admitting:
            self.log(f"HEALTH  ignoring node {e.node}'s admission of {e.device}: none was asked for")
            return
        self.admitting.discard(e.device)
        if e.cancelled:
            self.log(f"ADMISSION {e.device}: cut short; not admitted")
        elif e.passed:
            self.log(f"ADMISSION {e.device}: pass")
        else:
            self.registry.quarantine(e.device, f"failed admission: {e.detail}", actor="rule:admission")
            self.log(f"ADMISSION {e.device}: FAIL ({e.detail}): quarantined, it gets no work")


def _with_rank(v: Verdict, rank: int | None) -> Verdict:
    return dataclasses.replace(v, rank=rank)
