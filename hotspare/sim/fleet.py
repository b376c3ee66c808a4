"""Discrete-event fleet simulator: replay a year of failures against every recovery policy.

What the closed form cannot see, the simulator plays out failure by failure: per-kind detection
and repair times, rack-wide events, a finite warm-spare pool that empties when repairs are slow,
failures that strike during a recovery, and which in-memory copies are actually left.

How it stays honest and fast:
- The hotspare policy does not re-implement recovery: every failure is put to
  ``hotspare.policy.recovery.plan_recovery``, the coordinator's own decision, with the lost
  nodes, the surviving replicas of each lost shard and the warm spares left. Its answer
  ("memory", "wait" or "checkpoint") sets what the failure costs, priced per policy by
  ``pool.delay`` (dedicated spares, borrowed ones, or shrinking; see ``pool``).
- Failures are drawn up front with numpy (Poisson counts, uniform times, kinds by share) and the
  event loop only visits failures; checkpoints, steps and repairs are closed-form between them.
- Each seed replays the *same* failure trace under every policy (common random numbers), so
  the savings between them have much tighter intervals than any goodput alone.

Model, in the renewal terms of ``failure_math`` (so the two can be checked against each other):
the job runs in segments of ``interval`` compute + ``stall``; a failure stops it, is noticed
after the kind's detection latency, and then either resumes from memory after ``downtime`` (the
step in flight is redone) or rolls back to the last completed checkpoint and pays ``restart``.
A failure during a recovery joins it (a checkpoint restart starts over). A node counts as one
member: its 8 GPUs fail, move and are spared together. A shrinking job's progress follows
``clock.shrink_clock`` instead of the wall clock.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from collections import Counter
from itertools import islice
from typing import Callable

import numpy as np

from hotspare.errors import ConfigError
from hotspare.policy.recovery import plan_recovery
from hotspare.sim import failure_math as fm
from hotspare.sim import pool as pool_model
from hotspare.sim.clock import Clock, shrink_clock
from hotspare.sim.economics import POOL_EMPTY_TARGET, JobInputs, Plan, PlanInputs, evaluate
from hotspare.sim.presets import (DEFAULT_MIX, DEFAULT_RACK_NODES, HOURS_PER_YEAR, FailureKind,
                                  kept_state_exposure, mix_mean, node_hours_per_failure,
                                  nodes_per_failure, shares)
from hotspare.sim.stats import mean_ci

PLACEMENTS = ("spread", "packed")
# Every survivor of a shard holds the same committed step, so the decision needs only some of
# them; capping what we pass keeps pure data-parallel fleets (thousands of copies) fast.
MAX_SURVIVORS_PASSED = 2
_SEVERITY = {"memory": 0, "wait": 1, "checkpoint": 2}


@dataclasses.dataclass(frozen=True, kw_only=True)
class FleetConfig(JobInputs):
    """A job on a fleet. Detection, repair and state loss come per failure kind from ``mix``.

    ``replica_nodes`` nodes hold one full copy of the training state (one model-parallel group,
    e.g. TP8 x PP16 on 8-GPU nodes = 16 nodes); the job has gpus / (8 x replica_nodes) copies.
    ``placement`` says where copies of the same shard sit: "spread" puts them replica_nodes
    apart (a rack-wide event hits different shards), "packed" puts them on adjacent nodes (a
    rack-wide event can take every copy when there are no more copies than nodes in a rack).
    """
    mix: tuple[FailureKind, ...] = DEFAULT_MIX
    rack_nodes: int = DEFAULT_RACK_NODES
    placement: str = "spread"

    def validate(self) -> None:
        super().validate()
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)
        need(self.gpus % self.gpus_per_node == 0,
             f"gpus ({self.gpus}) must be a multiple of gpus-per-node ({self.gpus_per_node}): "
             f"spares and failures are whole nodes")
        need(self.replica_nodes >= 1 and self.nodes % self.replica_nodes == 0,
             f"the job's {self.nodes} nodes must be a whole number of copies of replica-nodes "
             f"({self.replica_nodes} nodes per copy of the state)")
        need(self.rack_nodes >= 1, "rack-nodes must be >= 1")
        need(self.placement in PLACEMENTS, f"placement must be one of {', '.join(PLACEMENTS)}")
        need(len(self.mix) > 0 and all(k.weight >= 0 for k in self.mix)
             and sum(k.weight for k in self.mix) > 0,
             "the failure mix needs at least one kind with a positive share")
        for k in self.mix:
            need(k.detect_h >= 0 and k.repair_h >= 0,
                 f"mix kind {k.name}: detect and repair must be >= 0")
            need(0 <= k.correlated <= 1 and 0 <= k.destroys_state <= 1,
                 f"mix kind {k.name}: correlated and destroys_state are probabilities in [0, 1]")

    def plan_inputs(self) -> PlanInputs:
        """The closed-form inputs this fleet reduces to: share-weighted detection and state loss,
        node-hours out per failure. Exact when detection is the same for every kind, no event is
        rack-wide and spares are plentiful; otherwise the simulator is the better answer."""
        common = {f.name: getattr(self, f.name) for f in dataclasses.fields(JobInputs)}
        return PlanInputs(**common, detect=mix_mean(self.mix, "detect_h"),
                          fallback=mix_mean(self.mix, "destroys_state"),
                          repair=node_hours_per_failure(self.mix, self.rack_nodes),
                          nodes_hit=nodes_per_failure(self.mix, self.rack_nodes),
                          **dict(zip(("kept_nodes", "kept_node_hours"),
                                     kept_state_exposure(self.mix, self.rack_nodes))),
                          repair_warmup=self.repair_warmup(), copy_hours=self.copy_hours())

    def copy_hours(self) -> float:
        """Copy-hours out per failure: a rack-wide event takes each copy that has a node in the
        rack once (with ``spread`` placement a rack's nodes mostly share one copy)."""
        shards = _Shards(self)
        starts = range(0, self.nodes, self.rack_nodes)
        distinct = sum(len({shards.copy_of(n) for n in range(a, min(a + self.rack_nodes, self.nodes))})
                       for a in starts) / len(starts)
        return sum(s * k.repair_h * (1.0 + k.correlated * (distinct - 1))
                   for s, k in zip(shares(self.mix), self.mix))

    def repair_warmup(self) -> float:
        """Mean nodes in repair over the run as a share of the steady state, kind by kind (each
        kind's repairs are exponential with its own mean, as ``_draw`` draws them)."""
        load = [s * k.repair_h * (1.0 + k.correlated * (self.rack_nodes - 1))
                for s, k in zip(shares(self.mix), self.mix)]
        total = sum(load)
        if total <= 0.0:
            return 1.0
        horizon = self.days * 24.0
        return sum(w * pool_model.warmup(horizon, k.repair_h) for w, k in zip(load, self.mix)) / total


@dataclasses.dataclass(frozen=True)
class _Trace:
    """One seed's failures, as plain lists (the event loop is faster on lists than arrays)."""
    times: list[float]
    detect: list[float]
    repair: list[float]
    destroys: list[bool]
    inflight: list[float]
    nodes: list[tuple[int, ...]]


def _draw(cfg: FleetConfig, lam: float, horizon: float, rng: np.random.Generator) -> _Trace:
    n = int(rng.poisson(lam * horizon))
    kind = rng.choice(len(cfg.mix), size=n, p=shares(cfg.mix))
    col = {f: np.array([getattr(k, f) for k in cfg.mix]) for f in ("detect_h", "repair_h",
                                                                     "correlated", "destroys_state")}
    first = rng.integers(0, cfg.nodes, size=n)
    rack_wide = rng.random(n) < col["correlated"][kind]
    nodes = []
    for node, wide in zip(first.tolist(), rack_wide.tolist()):
        if wide:
            start = node - node % cfg.rack_nodes
            nodes.append(tuple(range(start, min(start + cfg.rack_nodes, cfg.nodes))))
        else:
            nodes.append((node,))
    return _Trace(np.sort(rng.uniform(0.0, horizon, n)).tolist(), col["detect_h"][kind].tolist(),
                  (rng.exponential(1.0, n) * col["repair_h"][kind]).tolist(),
                  (rng.random(n) < col["destroys_state"][kind]).tolist(), rng.random(n).tolist(), nodes)


@dataclasses.dataclass(frozen=True)
class Run:
    """One policy on one seed."""
    goodput: float
    downtime: float        # hours not training: detection, recovery, restarts
    recomputed: float      # hours of computed work thrown away (x GPUs for GPU-hours)
    failures: int
    zero_loss: int         # failures recovered without losing a committed step
    pool_short: int        # failures that found too few warm spares or lenders (live policies)
    paths: dict[str, int]  # recovery path decided per failure
    useful_curve: tuple[tuple[float, float], ...]   # (hour, useful hours so far); empty unless asked
    lender_gpu_hours: float = 0.0   # lower-priority work lost to lending ("borrow" only)
    degraded: float = 0.0           # mean share of copies down while shrunk ("shrink" only)


class _Shards:
    """Which node holds which shard, and where its other copies are."""

    def __init__(self, cfg: FleetConfig):
        self.per_copy = cfg.replica_nodes
        self.copies = cfg.nodes // cfg.replica_nodes
        self.spread = cfg.placement == "spread"

    def of(self, node: int) -> int:
        return node % self.per_copy if self.spread else node // self.copies

    def copy_of(self, node: int) -> int:
        """Which copy of the state (data-parallel replica) the node belongs to."""
        return node // self.per_copy if self.spread else node % self.copies

    def replicas(self, shard: int):
        if self.spread:
            return range(shard, shard + self.per_copy * self.copies, self.per_copy)
        return range(shard * self.copies, (shard + 1) * self.copies)


def _hotspare_decision(nodes, destroyed, down, spares, starting, step, ckpt_step, shards):
    """Ask the coordinator's ``plan_recovery`` about each lost shard; the worst path wins.

    Survivors are the replicas of the shard that are not down in this incident (a replacement
    that has not received the state yet is not a copy). Returns (path, warm spares used,
    cold starts)."""
    if destroyed:
        plan = plan_recovery(nodes, {}, spares, starting, ckpt_step)
        return plan.path, plan.warm, plan.start
    by_shard: dict[int, list[int]] = {}
    for node in nodes:
        by_shard.setdefault(shards.of(node), []).append(node)
    path, warm, start = "memory", 0, 0
    for shard, lost in by_shard.items():
        survivors = islice((r for r in shards.replicas(shard) if r not in down), MAX_SURVIVORS_PASSED)
        plan = plan_recovery(lost, dict.fromkeys(survivors, step), spares - warm, starting + start,
                             ckpt_step)
        warm, start = warm + plan.warm, start + plan.start
        if _SEVERITY[plan.path] > _SEVERITY[path]:
            path = plan.path
    return path, warm, start


@dataclasses.dataclass(slots=True)
class _Incident:
    """The job is down: from the first failure until every failure that joined has been handled."""
    start: float           # when the job stopped
    pos: float             # where in its checkpoint segment it stopped
    since_ckpt: float      # compute hours since the last completed checkpoint
    in_step: bool          # stopped while computing (not while writing a checkpoint)
    ckpt_step: int         # step of the last completed checkpoint
    until: float           # when training resumes, as far as we know yet
    lost: float = 0.0      # compute hours this incident throws away
    path: str = "memory"   # worst recovery path so far
    failures: int = 0
    starting: int = 0      # cold replacements already starting
    down: set = dataclasses.field(default_factory=set)   # nodes lost in this incident


def _replay(cfg: FleetConfig, tr: _Trace, policy: str, interval: float, spares: int,
            record: bool, clock: Clock | None = None) -> Run:
    """One policy over one trace: "checkpoint", or live failover with "dedicated" spares (a pool
    of ``spares``), "borrow" (a pool of ``spares`` lendable nodes) or "shrink" (no pool; progress
    follows ``clock``)."""
    horizon = cfg.days * 24.0
    seg = interval + cfg.stall
    hotspare = policy != "checkpoint"
    overhead = cfg.overhead if hotspare else 0.0
    shards = _Shards(cfg)
    elapsed = clock if clock is not None else (lambda t: t)
    lender = 0.0

    def done(pos: float) -> float:          # compute hours completed at segment position ``pos``
        k = math.floor(pos / seg)
        return k * interval + min(pos - k * seg, interval)

    compute = lost = downtime = 0.0
    resume_t = resume_pos = 0.0
    failures = zero_loss = pool_short = 0
    paths: Counter[str] = Counter()
    pool, repairs = spares, []              # warm spare nodes now; heap of repair completions
    curve = [(0.0, 0.0)] if record else []
    inc: _Incident | None = None

    def close(end: float) -> None:
        nonlocal lost, downtime, zero_loss, resume_t, resume_pos, inc
        downtime += end - inc.start
        lost += inc.lost
        rolled_back = inc.path == "checkpoint"
        zero_loss += 0 if rolled_back else inc.failures
        resume_t, resume_pos = end, 0.0 if rolled_back else inc.pos
        if record:
            curve.append((end, (compute - lost) * (1.0 - overhead)))
        inc = None

    for t, detect, repair, destroyed, inflight, nodes in zip(
            tr.times, tr.detect, tr.repair, tr.destroys, tr.inflight, tr.nodes):
        if inc is not None and t >= inc.until:
            close(inc.until)
        if inc is None:                     # the job was training: stop it here
            pos = resume_pos + elapsed(t) - elapsed(resume_t)
            compute += done(pos) - done(resume_pos)
            in_segment = pos - math.floor(pos / seg) * seg
            since_ckpt = min(in_segment, interval)
            inc = _Incident(t, pos, since_ckpt, in_segment < interval,
                            int((compute - lost - since_ckpt) / cfg.step), until=t)
            if record:
                curve.append((t, (compute - lost) * (1.0 - overhead)))
        first = inc.failures == 0
        inc.failures += 1
        failures += 1
        if hotspare:
            while repairs and repairs[0] <= t:
                heapq.heappop(repairs)
                pool = min(spares, pool + 1)
            for node in nodes:
                heapq.heappush(repairs, t + repair)
            inc.down.update(nodes)
            # Shrinking replaces nobody: the lost ranks are dropped, so plan_recovery is asked
            # only whether a copy of their state survives (spares = as many as were lost).
            offer = len(nodes) if policy == "shrink" else pool
            path, warm, start = _hotspare_decision(nodes, destroyed, inc.down, offer, inc.starting,
                                                   int((compute - lost) / cfg.step), inc.ckpt_step, shards)
            if policy != "shrink":
                pool -= warm
            if policy == "borrow" and warm:
                lender += pool_model.lender_gpu_hours(
                    warm, repair, gpus_per_node=cfg.gpus_per_node, lender_nodes=cfg.lender_nodes,
                    lender=cfg.lender, lend_pause=cfg.lend_pause, lend_resume=cfg.lend_resume)
            inc.starting += start
            pool_short += path == "wait"
        else:
            path = "checkpoint"
        paths[path] += 1
        if path == "checkpoint" or inc.path == "checkpoint":
            inc.lost = inc.since_ckpt       # roll back to the last completed checkpoint
            inc.path = "checkpoint"
            end = t + detect + cfg.restart  # a restart interrupted by a failure starts over
        else:
            if first and inc.in_step:
                inc.lost = min(inflight * cfg.step, inc.since_ckpt)   # redo the step in flight
            if path == "wait":
                inc.path = "wait"
            end = t + detect + pool_model.delay(policy, path, downtime=cfg.downtime,
                                                lend_pause=cfg.lend_pause, cold_start=cfg.cold_start)
        inc.until = max(inc.until, end)

    if inc is not None and inc.until <= horizon:
        close(inc.until)
    if inc is None:
        compute += done(resume_pos + elapsed(horizon) - elapsed(resume_t)) - done(resume_pos)
    else:                                   # still down when the run ends
        downtime += horizon - inc.start
        lost += inc.lost
        zero_loss += 0 if inc.path == "checkpoint" else inc.failures
    useful = (compute - lost) * (1.0 - overhead)
    if record:
        curve.append((horizon, useful))
    return Run(useful / horizon, downtime, lost, failures, zero_loss, pool_short, dict(paths), tuple(curve),
               lender, clock.degraded if clock is not None else 0.0)


LIVE = ("hotspare", "borrow", "shrink")   # summary keys: dedicated spares, borrowed, shrink


@dataclasses.dataclass(frozen=True)
class FleetResult:
    config: FleetConfig
    plan: Plan                      # the closed form for the same inputs (see plan_inputs)
    spares: int
    checkpoint: list[Run]
    hotspare: list[Run]             # live failover with dedicated idle spares
    borrow: list[Run] = ()          # with replacements borrowed from ``lendable`` preemptible nodes
    shrink: list[Run] = ()          # with none, shrinking; empty when the job has one copy
    lendable: int = 0

    def summary(self, level: float = 0.95) -> dict:
        """Means with ``level`` confidence half-widths over seeds, per policy and for the saving
        of each live policy against checkpoint-restart on the same failures (after paying idle
        spares, or the lenders' lost work)."""
        cfg, horizon = self.config, self.config.days * 24.0
        year = HOURS_PER_YEAR / horizon
        spare_cost_run = self.spares * cfg.gpus_per_node * horizon * cfg.price

        def stat(values) -> dict:
            mean, half = mean_ci(values, level)
            return {"mean": mean, "ci": half}

        def waste_usd(run: Run) -> float:
            return (1.0 - run.goodput) * cfg.gpus * horizon * cfg.price

        extra_cost = {"checkpoint": lambda r: 0.0, "hotspare": lambda r: spare_cost_run,
                      "borrow": lambda r: r.lender_gpu_hours * cfg.price * cfg.lender_value,
                      "shrink": lambda r: 0.0}
        out: dict = {"seeds": len(self.checkpoint), "level": level, "spares": self.spares,
                     "lendable": self.lendable}
        for name in ("checkpoint", *LIVE):
            runs = getattr(self, name)
            if not runs:
                continue
            fails = sum(r.failures for r in runs)
            out[name] = {
                "goodput": stat([r.goodput for r in runs]),
                "downtime_hours": stat([r.downtime for r in runs]),
                "recomputed_gpu_hours": stat([r.recomputed * cfg.gpus for r in runs]),
                "wasted_usd_run": stat([waste_usd(r) for r in runs]),
                "wasted_usd_year": stat([waste_usd(r) * year for r in runs]),
                "failures": stat([r.failures for r in runs]),
                "zero_loss_share": sum(r.zero_loss for r in runs) / fails if fails else 0.0,
                "pool_short_events": stat([r.pool_short for r in runs]),
                "paths": dict(sum((Counter(r.paths) for r in runs), Counter())),
            }
            if name == "checkpoint":
                continue
            cost = extra_cost[name]
            saving = [waste_usd(c) - waste_usd(h) - cost(h) for c, h in zip(self.checkpoint, runs)]
            out[name]["cost_usd_year"] = stat([cost(r) * year for r in runs])
            out[name]["net_saving_usd_year"] = stat([v * year for v in saving])
            if name == "borrow":
                out[name]["lender_gpu_hours_year"] = stat([r.lender_gpu_hours * year for r in runs])
            if name == "shrink":
                out[name]["degraded"] = stat([r.degraded for r in runs])
            if name == "hotspare":
                out["spare_cost_usd_run"] = spare_cost_run
                out["net_saving_usd_run"] = stat(saving)
                out["net_saving_usd_year"] = stat([v * year for v in saving])
        return out


def auto_spares(cfg: FleetConfig, lam: float) -> int:
    """The closed form's pool (at most 1% of failures find it empty), but never smaller than one
    rack when rack-wide events are possible: each of those needs a rack's worth of nodes at once."""
    spares = fm.spares_needed(lam, node_hours_per_failure(cfg.mix, cfg.rack_nodes), POOL_EMPTY_TARGET)
    if any(k.weight > 0 and k.correlated > 0 for k in cfg.mix):
        spares = max(spares, cfg.rack_nodes)
    return spares


def simulate(cfg: FleetConfig, seeds: int = 20, seed: int = 0, record: bool = False,
             borrow_and_shrink: bool = True, progress: Callable[[], None] | None = None) -> FleetResult:
    """Replay ``seeds`` independent failure traces of the job under every policy: checkpoint-
    restart, and live failover with dedicated spares, borrowed ones and shrinking (the last two
    can be left out, e.g. for the plot's size sweep). ``progress``: called after each seed."""
    cfg.validate()
    if seeds < 1:
        raise ConfigError(f"seeds must be >= 1 (got {seeds})")
    lam = fm.failures_per_hour(cfg.afr, cfg.gpus)
    spares = cfg.spares if cfg.spares is not None else auto_spares(cfg, lam)
    plan = evaluate(dataclasses.replace(cfg.plan_inputs(), spares=spares))
    horizon, tau = cfg.days * 24.0, plan.hotspare.interval
    shards, lendable = _Shards(cfg), plan.borrowed.lendable
    runs: dict[str, list[Run]] = {"checkpoint": [], "hotspare": [], "borrow": [], "shrink": []}
    for child in np.random.SeedSequence(seed).spawn(seeds):
        trace = _draw(cfg, lam, horizon, np.random.default_rng(child))
        runs["checkpoint"].append(_replay(cfg, trace, "checkpoint", plan.checkpoint.interval, spares, record))
        runs["hotspare"].append(_replay(cfg, trace, "dedicated", tau, spares, record))
        if borrow_and_shrink:
            runs["borrow"].append(_replay(cfg, trace, "borrow", tau, lendable, record))
        if borrow_and_shrink and plan.shrunk is not None:
            clock = shrink_clock(trace.times, trace.repair, trace.nodes, shards.copy_of, shards.copies,
                                 cfg.downtime, horizon)
            runs["shrink"].append(_replay(cfg, trace, "shrink", tau, 0, record, clock))
        if progress is not None:
            progress()
    return FleetResult(cfg, plan, spares, runs["checkpoint"], runs["hotspare"], runs["borrow"],
                       runs["shrink"], lendable)
