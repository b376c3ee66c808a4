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
kept in the registry; quarantine diagnostics run in a background thread.
"""
from __future__ import annotations

import collections
import statistics
import threading
import time
from typing import Callable

from hotspare.health import types as T
from hotspare.health.checks.result import CheckCancelled
from hotspare.health.lifecycle import State
from hotspare.health.registry import Registry
from hotspare.health.rules import FleetState, RuleSet, apply_fleet_policies, evaluate, worst
from hotspare.health.types import Reading, Verdict

EVENT_METRICS = (T.FINGERPRINT_MISMATCH, T.NONFINITE)   # one-off runtime events
STRAGGLER_WINDOW = 10      # steps of compute time per rank behind one straggler score


class HealthMonitor:
    def __init__(self, rules: RuleSet, registry: Registry, devices: list[str],
                 log: Callable[[str], None] = print,
                 diagnose: Callable[[str, threading.Event], tuple[bool, str]] | None = None,
                 reset: Callable[[str], None] | None = None, diagnostics_passes: int = 2):
        """``diagnose(device, stop)`` runs a quarantined device's diagnostics in a background
        thread; it should give up with ``CheckCancelled`` soon after ``stop`` is set (``close``)."""
        self.rules, self.registry, self.devices, self.log = rules, registry, list(devices), log
        self.history: dict[str, list[Reading]] = {}
        self.rank_device: dict[int, str] = {}
        self.compute: dict[int, collections.deque] = {}
        self.window_median: dict[int, float] = {}
        self.remediations: list[tuple[float, str]] = []
        self.diagnose, self.reset, self.passes = diagnose, reset, diagnostics_passes
        self.diagnosing: set[str] = set()
        self.retiring: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()   # the job is stopping: start no diagnostics, cut running ones short
        self._revision = 0         # the registry's revision last seen (operator commands)
        self._said: dict[str, str] = {}
        for d in self.devices:
            self.registry.ensure(d)
            for t, _ in ((x, d) for x in self.registry.get(d).remediations):
                self.remediations.append((t, d))
        self._revision = self.registry.revision()
        for d in self.devices:     # a job that stopped mid-diagnostics left these: take them up again
            if self.registry.get(d).state == State.QUARANTINED:
                self._start_diagnostics(d)

    # ------------------------------------------------------------------ devices
    def usable(self, device: str) -> bool:
        """May a new worker start on ``device``? (healthy or merely suspect)."""
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

    def record_readings(self, readings: list[Reading]) -> None:
        try:
            self.registry.record_readings(readings)
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

    def operator_requests(self) -> list[Verdict]:
        """Operator commands given while the job runs (``hotspare drain DEVICE``): a drained
        device whose rank still runs there gets that rank live-migrated off it. (A cordon alone
        only stops new work, as in Kubernetes.)"""
        self._revision, changed = self.registry.changed_since(self._revision)
        out = []
        for rec in changed:
            rank = self.rank_on(rec.device)
            if rec.device in self.devices and rec.state == State.DRAINING and rec.actor == "operator" \
                    and rank is not None:
                out.append(Verdict(rec.device, T.MIGRATE, "operator-drain",
                                   f"drained by the operator: {rec.reason}", True, rank))
        return out

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
        if self.diagnose is None or device in self.diagnosing:
            return
        if self._stop.is_set():
            self.log(f"QUARANTINE {device}: the job is stopping; diagnostics not started (the device "
                     f"stays quarantined; the next job on this node diagnoses it)")
            return
        self.diagnosing.add(device)
        thread = threading.Thread(target=self._diagnostics, args=(device,), name=f"diagnose-{device}",
                                  daemon=True)
        self._threads.append(thread)
        thread.start()
        self.log(f"QUARANTINE {device}: drained; diagnostics started (burn-in, memory patterns; back in "
                 f"the pool after {self.passes} passes)")

    def close(self, timeout: float = 30.0, cancel: bool = False) -> None:
        """Wait for running diagnostics (a torch op cut off at interpreter exit aborts the process).
        ``cancel`` (Ctrl-C) cuts them short instead: each stops after its current step, and its
        device stays quarantined, with no verdict, until diagnostics pass another time."""
        if cancel:
            self._stop.set()
        deadline = time.time() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.time()))
        self._stop.set()

    def _diagnostics(self, device: str) -> None:
        try:
            if self.reset is not None:
                self.reset(device)               # e.g. a GPU reset; the simulated device resets
            for i in range(self.passes):
                ok, detail = self.diagnose(device, self._stop)
                if not ok:
                    self.registry.diagnostics_failed(device, detail)
                    self.log(f"QUARANTINE {device}: diagnostics failed ({detail}): {self.registry.get(device).state.value}")
                    return
                rec = self.registry.diagnostics_passed(device, detail)
                self.log(f"QUARANTINE {device}: diagnostics pass {i + 1}/{self.passes}: {detail}")
                if rec.state == State.HEALTHY:
                    self.history.pop(device, None)
                    self._said.pop(device, None)
                    self.log(f"HEALTHY {device}: back in the pool after {i + 1} passing diagnostics")
                    return
        except CheckCancelled:
            self.log(f"QUARANTINE {device}: diagnostics cut short, the job is stopping; the device stays "
                     f"quarantined and the next job on this node diagnoses it again")
        except Exception as e:  # noqa: BLE001
            self.log(f"QUARANTINE {device}: diagnostics could not run: {e}")
        finally:
            self.diagnosing.discard(device)


def _with_rank(v: Verdict, rank: int | None) -> Verdict:
    import dataclasses
    return dataclasses.replace(v, rank=rank)


def diagnose_device(device: str, source, rules: RuleSet, size: str = "small",
                    stop: threading.Event | None = None) -> tuple[bool, str]:
    """Quarantine diagnostics of one device: its telemetry must be clean again (after the reset)
    and the checks of hotspare.health.checks (burn-in against a float64 reference, memory
    patterns) must pass. Runs in the launcher, on the device's kind (CPU here). Setting ``stop``
    ends it early with ``CheckCancelled``."""
    import torch

    from hotspare.health.checks.burnin import burn_in
    from hotspare.health.checks.memory import memory_test
    from hotspare.health.checks.sizes import sizes_for

    now = time.time()
    readings = [r for r in source.poll() if r.device == device]
    bad = [v for v in evaluate(rules, readings, now) if T.SEVERITY[v.action] > T.SEVERITY[T.WATCH]]
    if bad:
        v = worst(bad)
        return False, f"telemetry still trips {v.rule}: {v.reason}"
    kind = "gpu" if "/gpu" in device else "cpu"
    torch_device = f"cuda:{device.rsplit('gpu', 1)[1]}" if kind == "gpu" else "cpu"
    sizes = sizes_for("quarantine", kind, size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)           # the launcher shares the node with the training workers
    try:
        results = [burn_in(device, torch_device, n=sizes.matmul_n, reps=sizes.burn_reps,
                           seconds=sizes.burn_seconds, stop=stop),
                   memory_test(device, torch_device, nbytes=sizes.mem_bytes, stop=stop)]
    finally:
        torch.set_num_threads(threads)
    failed = [f"{r.name}: {r.detail}" for r in results if not r.passed]
    if failed:
        return False, "; ".join(failed)
    return True, "telemetry clean; " + "; ".join(f"{r.name} ok" for r in results)
