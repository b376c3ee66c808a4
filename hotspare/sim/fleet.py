"""Discrete-event fleet simulator: replay a year of failures against both recovery policies.

What the closed form cannot see, the simulator plays out failure by failure: per-kind detection
and repair times, rack-wide events, a finite warm-spare pool that empties when repairs are slow,
failures that strike during a recovery, and which in-memory copies are actually left.

How it stays honest and fast:
- The hotspare policy does not re-implement recovery: every failure is put to
  ``hotspare.policy.recovery.plan_recovery``, the coordinator's own decision, with the lost
  nodes, the surviving replicas of each lost shard and the warm spares left. Its answer
  ("memory", "wait" or "checkpoint") sets what the failure costs.
- Failures are drawn up front with numpy (Poisson counts, uniform times, kinds by share) and the
  event loop only visits failures; checkpoints, steps and repairs are closed-form between them.
- Each seed replays the *same* failure trace under both policies (common random numbers), so
  the saving between them has a much tighter interval than either goodput alone.

Model, in the renewal terms of ``failure_math`` (so the two can be checked against each other):
the job runs in segments of ``interval`` compute + ``stall``; a failure stops it, is noticed
after the kind's detection latency, and then either resumes from memory after ``downtime`` (the
step in flight is redone) or rolls back to the last completed checkpoint and pays ``restart``.
A failure during a recovery joins it (a checkpoint restart starts over). A node counts as one
member: its 8 GPUs fail, move and are spared together.
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
from hotspare.sim.economics import POOL_EMPTY_TARGET, JobInputs, Plan, PlanInputs, evaluate
from hotspare.sim.presets import (DEFAULT_MIX, DEFAULT_RACK_NODES, HOURS_PER_YEAR, FailureKind,
                                  mix_mean, node_hours_per_failure, shares)
from hotspare.sim.stats import mean_ci

PLACEMENTS = ("spread", "packed")
# Every survivor of a shard holds the same committed step, so the decision needs only some of
# them; capping what we pass keeps pure data-parallel fleets (thousands of copies) fast.
MAX_SURVIVORS_PASSED = 64
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
    replica_nodes: int = 16
    placement: str = "spread"

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

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
                          repair=node_hours_per_failure(self.mix, self.rack_nodes))


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
    pool_short: int        # failures that found too few warm spares (hotspare only)
    paths: dict[str, int]  # recovery path decided per failure
    useful_curve: tuple[tuple[float, float], ...]   # (hour, useful hours so far); empty unless asked


class _Shards:
    """Which node holds which shard, and where its other copies are."""

    def __init__(self, cfg: FleetConfig):
        self.per_copy = cfg.replica_nodes
        self.copies = cfg.nodes // cfg.replica_nodes
        self.spread = cfg.placement == "spread"

    def of(self, node: int) -> int:
        return node % self.per_copy if self.spread else node // self.copies

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


def _replay(cfg: FleetConfig, tr: _Trace, hotspare: bool, interval: float, spares: int,
            record: bool) -> Run:
    horizon = cfg.days * 24.0
    seg = interval + cfg.stall
    overhead = cfg.overhead if hotspare else 0.0
    shards = _Shards(cfg)

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
            pos = resume_pos + (t - resume_t)
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
            path, warm, start = _hotspare_decision(nodes, destroyed, inc.down, pool, inc.starting,
                                                   int((compute - lost) / cfg.step), inc.ckpt_step, shards)
            pool -= warm
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
            end = t + detect + (cfg.cold_start if path == "wait" else 0.0) + cfg.downtime
        inc.until = max(inc.until, end)

    if inc is not None and inc.until <= horizon:
        close(inc.until)
    if inc is None:
        compute += done(resume_pos + horizon - resume_t) - done(resume_pos)
    else:                                   # still down when the run ends
        downtime += horizon - inc.start
        lost += inc.lost
        zero_loss += 0 if inc.path == "checkpoint" else inc.failures
    useful = (compute - lost) * (1.0 - overhead)
    if record:
        curve.append((horizon, useful))
    return Run(useful / horizon, downtime, lost, failures, zero_loss, pool_short, dict(paths), tuple(curve))


@dataclasses.dataclass(frozen=True)
class FleetResult:
    config: FleetConfig
    plan: Plan                      # the closed form for the same inputs (see plan_inputs)
    spares: int
    checkpoint: list[Run]
    hotspare: list[Run]

    def summary(self, level: float = 0.95) -> dict:
        """Means with ``level`` confidence half-widths over seeds, per policy and for the saving."""
        cfg, horizon = self.config, self.config.days * 24.0
        year = HOURS_PER_YEAR / horizon
        spare_cost_run = self.spares * cfg.gpus_per_node * horizon * cfg.price

        def stat(values) -> dict:
            mean, half = mean_ci(values, level)
            return {"mean": mean, "ci": half}

        def waste_usd(run: Run) -> float:
            return (1.0 - run.goodput) * cfg.gpus * horizon * cfg.price

        out: dict = {"seeds": len(self.checkpoint), "level": level, "spares": self.spares}
        for name, runs in (("checkpoint", self.checkpoint), ("hotspare", self.hotspare)):
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
        saving = [waste_usd(c) - waste_usd(h) - spare_cost_run for c, h in zip(self.checkpoint, self.hotspare)]
        out["spare_cost_usd_run"] = spare_cost_run
        out["net_saving_usd_run"] = stat(saving)
        out["net_saving_usd_year"] = stat([s * year for s in saving])
        return out


def auto_spares(cfg: FleetConfig, lam: float) -> int:
    """The closed form's pool (at most 1% of failures find it empty), but never smaller than one
    rack when rack-wide events are possible: each of those needs a rack's worth of nodes at once."""
    spares = fm.spares_needed(lam, node_hours_per_failure(cfg.mix, cfg.rack_nodes), POOL_EMPTY_TARGET)
    if any(k.weight > 0 and k.correlated > 0 for k in cfg.mix):
        spares = max(spares, cfg.rack_nodes)
    return spares


def simulate(cfg: FleetConfig, seeds: int = 20, seed: int = 0, record: bool = False,
             progress: Callable[[], None] | None = None) -> FleetResult:
    """Replay ``seeds`` independent failure traces of the job under both policies
    (``progress``: called after each seed)."""
    cfg.validate()
    if seeds < 1:
        raise ConfigError(f"seeds must be >= 1 (got {seeds})")
    lam = fm.failures_per_hour(cfg.afr, cfg.gpus)
    spares = cfg.spares if cfg.spares is not None else auto_spares(cfg, lam)
    plan = evaluate(dataclasses.replace(cfg.plan_inputs(), spares=spares))
    cr, hs = [], []
    for child in np.random.SeedSequence(seed).spawn(seeds):
        trace = _draw(cfg, lam, cfg.days * 24.0, np.random.default_rng(child))
        cr.append(_replay(cfg, trace, False, plan.checkpoint.interval, spares, record))
        hs.append(_replay(cfg, trace, True, plan.hotspare.interval, spares, record))
        if progress is not None:
            progress()
    return FleetResult(cfg, plan, spares, cr, hs)
