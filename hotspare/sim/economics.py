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
- "optimal" intervals are Daly's, capped at 24 h: teams keep at least a daily checkpoint for
  reasons this model does not price (code changes, evaluation, disasters).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

from hotspare.errors import ConfigError
from hotspare.sim import failure_math as fm
from hotspare.sim.presets import (DEFAULT_MIX, DEFAULT_PRESET, DEFAULT_RACK_NODES, HOURS_PER_YEAR,
                                  PRESETS, mix_mean, node_hours_per_failure)
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanInputs(JobInputs):
    """Adds what the closed form needs as single numbers; the simulator takes them per failure
    kind instead. Defaults are the share-weighted means of the default failure mix."""
    detect: float = mix_mean(DEFAULT_MIX, "detect_h")
    fallback: float = mix_mean(DEFAULT_MIX, "destroys_state")   # p_f
    repair: float = node_hours_per_failure(DEFAULT_MIX, DEFAULT_RACK_NODES)  # node-hours out per failure

    def validate(self) -> None:
        super().validate()
        if self.detect < 0 or self.repair < 0:
            raise ConfigError("detect and repair must be >= 0")
        if not 0 <= self.fallback <= 1:
            raise ConfigError(f"fallback must be in [0, 100%] (got {self.fallback:.2%})")


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
                break_even)


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
