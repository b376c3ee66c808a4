"""The two pictures that carry the argument: goodput as the job grows, and waste piling up.

matplotlib is imported inside ``plot_economics`` so nothing else pays for it.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import numpy as np

from hotspare.sim.fleet import FleetResult, simulate
from hotspare.sim.units import fmt_duration

_COLORS = {"checkpoint": "#c0392b", "hotspare": "#2471a3"}
_LABELS = {"checkpoint": "checkpoint-restart", "hotspare": "hotspare live failover"}


def _waste_curves(result: FleetResult, policy: str, grid: np.ndarray) -> np.ndarray:
    """Cumulative wasted GPU-hours on ``grid`` (hours), one row per seed."""
    gpus = result.config.gpus
    rows = []
    for run in getattr(result, policy):
        t, useful = np.array(run.useful_curve).T
        rows.append(gpus * (grid - np.interp(grid, t, useful)))
    return np.array(rows)


def plot_economics(result: FleetResult, sizes: list[int], seed: int, path: Path,
                   progress: Callable[[], None] | None = None) -> list[tuple[int, FleetResult]]:
    """Draw goodput vs. cluster size (simulated, with the closed form as lines) and the
    cumulative waste of ``result`` (simulated with ``record=True``); return the per-size results
    so callers can report them. Every size replays ``seed``'s seeds; ``progress``: called after
    each seed of each size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    cfg, seeds = result.config, len(result.checkpoint)
    per_size = [(n, simulate(dataclasses.replace(cfg, gpus=n), seeds, seed, borrow_and_shrink=False,
                             progress=progress)) for n in sizes]

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for policy in ("checkpoint", "hotspare"):
        stats = [r.summary()[policy]["goodput"] for _, r in per_size]
        left.errorbar(sizes, [100 * s["mean"] for s in stats], yerr=[100 * s["ci"] for s in stats],
                      fmt="o", capsize=3, color=_COLORS[policy], label=f"{_LABELS[policy]} (simulated)")
        formula = [getattr(r.plan, policy).goodput * 100 for _, r in per_size]
        left.plot(sizes, formula, "--", color=_COLORS[policy], alpha=0.7,
                  label=f"{_LABELS[policy]} (closed form)")
    left.set_xscale("log", base=2)
    left.set_xticks(sizes, [f"{n:,}" for n in sizes], rotation=30)
    left.set_xlabel("GPUs in the job")
    left.set_ylabel("goodput (%)")
    left.set_title(f"Goodput vs. job size ({cfg.days:g}-day runs, {seeds} seeds, 95% CI)")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)

    horizon = cfg.days * 24.0
    grid = np.linspace(0.0, horizon, 400)
    days = grid / 24.0
    for policy in ("checkpoint", "hotspare"):
        curves = _waste_curves(result, policy, grid)
        if policy == "hotspare":
            right.plot(days, np.median(curves, axis=0), ":", color=_COLORS[policy],
                       label=f"{_LABELS[policy]}, failures only")
            curves = curves + result.spares * cfg.gpus_per_node * grid   # idle spares are waste too
        lo, mid, hi = np.percentile(curves, [10, 50, 90], axis=0)
        label = _LABELS[policy] + (" + idle spares" if policy == "hotspare" else "")
        right.plot(days, mid, color=_COLORS[policy], label=f"{label} (median)")
        right.fill_between(days, lo, hi, color=_COLORS[policy], alpha=0.2, lw=0)
    right.set_xlabel("days into the run")
    right.set_ylabel("wasted GPU-hours (cumulative)")
    right.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    right.set_title(f"Cumulative waste, {cfg.gpus:,} GPUs (band: 10-90% of seeds)")
    right.grid(alpha=0.3)
    right.legend(fontsize=8, loc="upper left")

    plan = result.plan
    fig.suptitle(f"{cfg.afr:.1%} failures/GPU-year; restart {fmt_duration(cfg.restart)}, stall "
                 f"{fmt_duration(cfg.stall)}, live downtime {fmt_duration(cfg.downtime)}, overhead "
                 f"{cfg.overhead:.1%}, fallback {plan.inputs.fallback:.1%}, {result.spares} spare nodes",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return per_size
