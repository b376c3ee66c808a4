"""What failures cost under checkpoint-restart and under live failover, in GPU-hours and dollars.

Everything here is a closed form over ``PlanInputs`` (hours throughout), so ``hotspare plan``
answers instantly and the simulator can be checked against the same numbers.

Accounting choices, stated because they move the answer:
- Wasted time is (1 − goodput) × GPUs × hours: checkpoint stalls, recomputed work, downtime.
  "Per year" means the same job size kept busy for 8,760 hours.
- Warm spares are charged to live failover only, at the full GPU price, all year. Checkpoint-
  restart also needs replacement nodes, but can take them from the general pool when it
  restarts (that delay is part of R), so it is not charged for reserving any.
- Live failover still checkpoints, for the failures that leave no in-memory copy; its default
  interval is the optimum for that (much lower) fallback rate.
- Live failover gets its replacements one of three ways (``pool``): dedicated warm spares
  (charged as above), nodes borrowed from lower-priority work (charged the GPU-hours the lenders
  lose, at ``lender_value`` × price), or none: shrinking, charged only through its own lower
  throughput. All three share the same checkpoint interval and overhead.
- "optimal" intervals are Daly's, capped at 24 h: teams keep at least a daily checkpoint for
  reasons this model does not price (code changes, evaluation, disasters).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

from hotspare.errors import ConfigError
from hotspare.sim import failure_math as fm
from hotspare.sim import pool
from hotspare.sim.presets import (DEFAULT_MIX, DEFAULT_PRESET, DEFAULT_RACK_NODES, HOURS_PER_YEAR,
                                  PRESETS, mix_mean, node_hours_per_failure, nodes_per_failure)
from hotspare.sim.units import fmt_duration

MAX_INTERVAL_H = 24.0
POOL_EMPTY_TARGET = 0.01  # "auto" spares: at most 1% of failures may find the pool empty


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobInputs:
    """A training job and both ways of surviving its failures. Durations in hours.

    ``interval`` and ``hotspare_interval`` are compute time between checkpoints (None: optimal);
    ``restart`` and ``downtime`` start once the failure has been detected.
    """
    gpus: int
    days: float = 30.0
    afr: float = PRESETS[DEFAULT_PRESET].per_gpu_year   # failures per GPU-year
    price: float = 3.0                                   # USD per GPU-hour
    gpus_per_node: int = 8
    step: float = 10 / 3600
    stall: float = 2 / 60
    interval: float | None = None
    restart: float = 0.5
    downtime: float = 2 / 60
    overhead: float = 0.01
    hotspare_interval: float | None = None
    spares: int | None = None                            # warm spare nodes; None: enough for ≤1% empty
    cold_start: float = 0.25
    replica_nodes: int = 16                              # nodes holding one copy of the state
    # Borrowing from lower-priority work and shrinking (see ``pool``; defaults argued in
    # docs/ECONOMICS.md, "Spares from the shared pool").
    lendable_share: float = 0.10                         # preemptible nodes, as a share of the job's
    lend_pause: float = 30 / 3600                        # lender stops and parks its state
    lend_resume: float = 5 / 60                          # lender starts again once handed back
    lender_nodes: int = 1                                # size of a lending job
    lender: str = "pause"                                # "pause" or "shrink" (an elastic lender)
    lender_value: float = 1.0                            # a lender GPU-hour, as a share of the price

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    def validate(self) -> None:
        """Raise ConfigError naming the first impossible input and how to fix it."""
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)
        numbers = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        bad = [name for name, v in numbers.items() if isinstance(v, float) and not math.isfinite(v)]
        need(not bad, f"{', '.join(bad)} must be finite")
        need(isinstance(self.gpus, int) and self.gpus >= 1,
             f"gpus must be a whole number of at least 1 (got {self.gpus})")
        need(isinstance(self.gpus_per_node, int) and self.gpus_per_node >= 1,
             f"gpus-per-node must be a whole number of at least 1 (got {self.gpus_per_node})")
        need(self.days > 0, f"days must be > 0 (got {self.days})")
        need(self.afr > 0, f"afr must be > 0 failures per GPU-year (got {self.afr}); "
                           f"a negative or zero rate leaves nothing to plan")
        need(self.price >= 0, f"price must be >= 0 USD per GPU-hour (got {self.price})")
        need(self.step > 0, "step-time must be > 0")
        need(self.stall > 0, "stall must be > 0 (for asynchronous checkpoints give the short "
                             "pause they still cause, e.g. 5s)")
        for name in ("restart", "downtime", "cold_start"):
            need(getattr(self, name) >= 0, f"{name.replace('_', '-')} must be >= 0")
        need(0 <= self.overhead < 1, f"overhead must be in [0, 100%) (got {self.overhead:.2%})")
        for name in ("interval", "hotspare_interval"):
            value = getattr(self, name)
            flag = name.replace("_", "-")
            need(value is None or value > self.stall,
                 f"{flag} ({fmt_duration(value or 0)}) must be longer than the checkpoint stall "
                 f"({fmt_duration(self.stall)}): the job would spend more time saving than training")
            need(value is None or value >= self.step,
                 f"{flag} ({fmt_duration(value or 0)}) must be at least one step "
                 f"({fmt_duration(self.step)})")
        need(self.spares is None or (isinstance(self.spares, int) and self.spares >= 0),
             f"spares must be a whole number of nodes >= 0 or 'auto' (got {self.spares})")
        need(isinstance(self.replica_nodes, int) and self.replica_nodes >= 1,
             f"replica-nodes must be a whole number of at least 1 (got {self.replica_nodes})")
        need(0 <= self.lendable_share, f"lendable must be >= 0 (got {self.lendable_share:.1%})")
        need(self.lend_pause >= 0 and self.lend_resume >= 0, "lend-pause and lend-resume must be >= 0")
        need(isinstance(self.lender_nodes, int) and self.lender_nodes >= 1,
             f"lender-nodes must be a whole number of at least 1 (got {self.lender_nodes})")
        need(self.lender in pool.LENDERS,
             f"lender must be one of {', '.join(pool.LENDERS)} (got {self.lender!r})")
        need(self.lender_value >= 0, f"lender-value must be >= 0 (got {self.lender_value})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanInputs(JobInputs):
    """Adds what the closed form needs as single numbers; the simulator takes them per failure
    kind instead. Defaults are the share-weighted means of the default failure mix."""
    detect: float = mix_mean(DEFAULT_MIX, "detect_h")
    fallback: float = mix_mean(DEFAULT_MIX, "destroys_state")   # p_f
    repair: float = node_hours_per_failure(DEFAULT_MIX, DEFAULT_RACK_NODES)  # node-hours out per failure
    nodes_hit: float = nodes_per_failure(DEFAULT_MIX, DEFAULT_RACK_NODES)    # nodes lost per failure
    # Per failure, over failures that keep their state (the ones a replacement is borrowed for):
    # nodes replaced and node-hours until repaired. None: (1 − fallback) × nodes_hit and × repair,
    # exact when state loss does not depend on the kind of failure; the simulator passes the mix's.
    kept_nodes: float | None = None
    kept_node_hours: float | None = None
    # Mean nodes in repair over the run, as a share of the steady state (the run starts with none).
    # None: ``pool.warmup`` for one mean repair time; the simulator passes the mix's, kind by kind.
    repair_warmup: float | None = None
    # Copy-hours out per failure, for shrinking: a failure that takes several nodes of one copy
    # takes that copy once. None: ``repair``, as if every lost node were in a different copy.
    copy_hours: float | None = None

    def validate(self) -> None:
        super().validate()
        if self.detect < 0 or self.repair < 0:
            raise ConfigError("detect and repair must be >= 0")
        if not 0 <= self.fallback <= 1:
            raise ConfigError(f"fallback must be in [0, 100%] (got {self.fallback:.2%})")
        if self.nodes_hit < 1:
            raise ConfigError("nodes_hit must be >= 1")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One policy's result: goodput and what the rest of the time costs."""
    goodput: float
    interval: float
    interval_rule: str
    wasted_gpu_hours_run: float
    wasted_gpu_hours_year: float
    wasted_usd_run: float
    wasted_usd_year: float


@dataclasses.dataclass(frozen=True)
class Borrowed:
    """Live failover with replacements borrowed from lower-priority work (``pool``, "borrow")."""
    outcome: Outcome
    lendable: int                  # nodes of preemptible work the job may borrow
    no_lender: float               # share of failures that find nothing to borrow (Erlang B)
    lender_gpu_hours_year: float   # lower-priority work lost to pauses, holds and resumes
    lender_cost_usd_year: float
    net_saving_usd_year: float


@dataclasses.dataclass(frozen=True)
class Shrunk:
    """Live failover with no replacement: train on the surviving copies (``pool``, "shrink")."""
    outcome: Outcome
    copies: int
    degraded: float                # mean share of copies down for repair
    net_saving_usd_year: float


@dataclasses.dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    failures_per_hour: float
    mtbf: float
    expected_failures: float
    p_any_failure: float
    checkpoint: Outcome
    hotspare: Outcome
    spares: int
    pool_empty: float
    spare_cost_usd_run: float
    spare_cost_usd_year: float
    net_saving_usd_run: float
    net_saving_usd_year: float
    break_even_overhead: float   # overhead above which live failover stops paying (< 0: never pays)
    borrowed: Borrowed
    shrunk: Shrunk | None        # None: fewer than two copies of the state, nothing to shrink to


def resolve_interval(given: float | None, stall: float, mtbf: float) -> tuple[float, str]:
    if given is not None:
        return given, "given"
    if math.isinf(mtbf):
        return MAX_INTERVAL_H, "daily (no failure is expected to need a checkpoint)"
    tau = fm.daly_interval(stall, mtbf)
    if tau > MAX_INTERVAL_H:
        return MAX_INTERVAL_H, f"Daly optimum {fmt_duration(tau)}, capped at 24 h"
    return tau, "Daly optimum"


def _outcome(inp: PlanInputs, goodput: float, interval: float, rule: str) -> Outcome:
    run_hours = inp.days * 24.0
    waste = 1.0 - goodput
    return Outcome(goodput, interval, rule,
                   waste * inp.gpus * run_hours, waste * inp.gpus * HOURS_PER_YEAR,
                   waste * inp.gpus * run_hours * inp.price, waste * inp.gpus * HOURS_PER_YEAR * inp.price)


def evaluate(inp: PlanInputs) -> Plan:
    inp.validate()
    lam = fm.failures_per_hour(inp.afr, inp.gpus)
    mtbf = 1.0 / lam
    restart = inp.detect + inp.restart

    tau, rule = resolve_interval(inp.interval, inp.stall, mtbf)
    cr = _outcome(inp, fm.checkpoint_goodput(lam, tau, inp.stall, restart), tau, rule)

    # Each failure takes ``repair`` node-hours out of service; the spare pool covers the gap.
    spares = fm.spares_needed(lam, inp.repair, POOL_EMPTY_TARGET) if inp.spares is None else inp.spares
    pool_empty = fm.pool_empty_probability(lam, inp.repair, spares)
    live_downtime = inp.detect + inp.downtime + pool_empty * inp.cold_start
    fallback_mtbf = mtbf / inp.fallback if inp.fallback > 0 else float("inf")
    tau_p, rule_p = resolve_interval(inp.hotspare_interval, inp.stall, fallback_mtbf)

    def live(overhead: float) -> float:
        return fm.live_goodput(lam, inp.fallback, live_downtime, inp.step, tau_p, inp.stall,
                               restart, overhead)
    hs = _outcome(inp, live(inp.overhead), tau_p, rule_p)

    spare_gpus = spares * inp.gpus_per_node
    spare_run = spare_gpus * inp.days * 24.0 * inp.price
    spare_year = spare_gpus * HOURS_PER_YEAR * inp.price
    # Live goodput is (1 − o_s) × its zero-overhead value, so the break-even is closed form.
    break_even = 1.0 - (cr.goodput + spare_gpus / inp.gpus) / live(0.0)
    return Plan(inp, lam, mtbf, fm.expected_failures(inp.afr, inp.gpus, inp.days),
                fm.p_at_least_one(inp.afr, inp.gpus, inp.days), cr, hs, spares, pool_empty,
                spare_run, spare_year,
                cr.wasted_usd_run - hs.wasted_usd_run - spare_run,
                cr.wasted_usd_year - hs.wasted_usd_year - spare_year,
                break_even, _borrowed(inp, lam, restart, tau_p, rule_p, cr),
                _shrunk(inp, lam, restart, tau_p, rule_p, cr))


def _borrowed(inp: PlanInputs, lam: float, restart: float, tau: float, rule: str, cr: Outcome) -> Borrowed:
    """The lendable nodes are the pool (Erlang B again, since a borrowed node is held for the
    repair like a spare); every live recovery also waits out the lender's pause."""
    lendable = pool.lendable_nodes(inp.lendable_share, inp.nodes)
    no_lender = fm.pool_empty_probability(lam, inp.repair, lendable)
    down = inp.detect + pool.expected_delay("borrow", no_lender, downtime=inp.downtime,
                                            lend_pause=inp.lend_pause, cold_start=inp.cold_start)
    out = _outcome(inp, fm.live_goodput(lam, inp.fallback, down, inp.step, tau, inp.stall, restart,
                                        inp.overhead), tau, rule)
    # lender_gpu_hours is linear in (nodes, nodes × hold), so its mean is exact from the means.
    kept_nodes = (1.0 - inp.fallback) * inp.nodes_hit if inp.kept_nodes is None else inp.kept_nodes
    kept_hours = (1.0 - inp.fallback) * inp.repair if inp.kept_node_hours is None else inp.kept_node_hours
    per_failure = pool.lender_gpu_hours(kept_nodes, kept_hours / kept_nodes if kept_nodes else 0.0,
                                        gpus_per_node=inp.gpus_per_node, lender_nodes=inp.lender_nodes,
                                        lender=inp.lender, lend_pause=inp.lend_pause,
                                        lend_resume=inp.lend_resume)
    lender_year = lam * (1.0 - no_lender) * per_failure * HOURS_PER_YEAR
    lender_usd = lender_year * inp.price * inp.lender_value
    return Borrowed(out, lendable, no_lender, lender_year, lender_usd,
                    cr.wasted_usd_year - out.wasted_usd_year - lender_usd)


def _shrunk(inp: PlanInputs, lam: float, restart: float, tau: float, rule: str,
            cr: Outcome) -> Shrunk | None:
    """Stop to drop the broken copy (detect + downtime), train on the rest while the node is in
    repair, stop again (downtime) to take it back.

    While shrunk the job progresses at ρ = 1 − degraded of full speed. Measured in progress rather
    than wall time, that is a job at full speed whose failures come Λ/ρ per hour and whose stops
    (recovery, restart) last ρ times as long; its wall-clock goodput is ρ times that job's. The
    checkpoint stall is slowed with the job, as the simulator's clock does (``clock``)."""
    n_copies = pool.copies(inp.nodes, inp.replica_nodes)
    if n_copies < 2:
        return None
    # The run starts with no node in repair; over a run a few repair times long that matters.
    warm = (pool.warmup(inp.days * 24.0, inp.repair / inp.nodes_hit) if inp.repair_warmup is None
            else inp.repair_warmup)
    mean_out = lam * (inp.repair if inp.copy_hours is None else inp.copy_hours) * warm
    degraded = pool.degraded_share(mean_out, n_copies)
    rho = 1.0 - degraded
    down = inp.detect + pool.expected_delay("shrink", 0.0, downtime=inp.downtime,
                                            lend_pause=inp.lend_pause, cold_start=inp.cold_start)
    live = rho * fm.live_goodput(lam / rho, inp.fallback, down * rho, inp.step, tau, inp.stall,
                                 restart * rho, inp.overhead)
    out = _outcome(inp, live * pool.regrow_factor(lam, degraded, inp.downtime), tau, rule)
    return Shrunk(out, n_copies, degraded, cr.wasted_usd_year - out.wasted_usd_year)


def cheapest(plan: Plan) -> tuple[str, float]:
    """The policy with the largest yearly net saving against checkpoint-restart (which saves 0)."""
    options = [("checkpoint-restart", 0.0), ("dedicated spares", plan.net_saving_usd_year),
               ("borrowed", plan.borrowed.net_saving_usd_year)]
    if plan.shrunk is not None:
        options.append(("shrink", plan.shrunk.net_saving_usd_year))
    return max(options, key=lambda o: o[1])


@dataclasses.dataclass(frozen=True)
class Driver:
    """How the yearly net saving moves when one input is halved and doubled."""
    name: str
    low: float
    high: float
    saving_low: float | None     # None: the changed input would be impossible (e.g. stall > interval)
    saving_high: float | None

    @property
    def swing(self) -> float:
        known = [s for s in (self.saving_low, self.saving_high) if s is not None]
        return max(known) - min(known) if known else 0.0


_CAPS: dict[str, Callable[[float], float]] = {
    "fallback": lambda v: min(v, 1.0),
    "overhead": lambda v: min(v, 0.99),
}


def drivers(inp: PlanInputs) -> list[Driver]:
    """One-at-a-time sensitivity of the net saving, largest swing first: which assumptions
    actually decide the answer, so a reader knows which of their numbers to check."""
    names = ["afr", "restart", "stall", "downtime", "detect", "overhead", "fallback", "repair"]
    names += [n for n in ("interval", "hotspare_interval") if getattr(inp, n) is not None]
    out = []
    for name in names:
        base = getattr(inp, name)
        low, high = base / 2.0, _CAPS.get(name, lambda v: v)(base * 2.0)
        savings = []
        for value in (low, high):
            try:
                savings.append(evaluate(dataclasses.replace(inp, **{name: value})).net_saving_usd_year)
            except ConfigError:
                savings.append(None)
        out.append(Driver(name, low, high, *savings))
    return sorted(out, key=lambda d: -d.swing)
