"""``hotspare simulate``: replay failures on a fleet under both recovery policies.

Takes the same job description as ``hotspare plan`` (same flags, same config keys) plus the
fleet: failure mix, racks, replica layout, seeds. numpy (and matplotlib for --plot) are imported
only when the command runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import textwrap
from pathlib import Path

from hotspare.cli.plan import (OPTIONS as PLAN_OPTIONS, Option, add_options, convert,
                               describe_rate, gather, job_fields, plan_json, rates, values)
from hotspare.cli.simulate_sharded import DESTS as SHARDED_DESTS, SHARDED_OPTIONS, requested, run_sharded
from hotspare.errors import ConfigError
from hotspare.sim.presets import DEFAULT_MIX, FailureKind, shares
from hotspare.sim.units import fmt_duration, fmt_usd, parse_duration

FLEET = "the fleet and the replay"
_OVERRIDES = {"detect": "detect_h", "fallback": "destroys_state", "repair": "repair_h"}


def _mix_help() -> str:
    rows = [f"{k.name} {s:.1%} (detect {fmt_duration(k.detect_h)}, repair {fmt_duration(k.repair_h)}"
            + (f", rack-wide {k.correlated:.0%}" if k.correlated else "")
            + (f", destroys state {k.destroys_state:.0%}" if k.destroys_state else "") + ")"
            for s, k in zip(shares(DEFAULT_MIX), DEFAULT_MIX)]
    return ("failure kinds and their relative weights, e.g. gpu=3,software=1 (kinds not listed get "
            "none). Default, from Llama 3's interruption table: " + "; ".join(rows))


OPTIONS = [o for o in PLAN_OPTIONS if o.dest not in _OVERRIDES] + [
    Option("--detect", "duration", "DUR", "detection latency for every kind, replacing the mix's "
           "per-kind values", FLEET),
    Option("--fallback", "fraction", "FRAC", "chance that a failure of any kind destroys every "
           "in-memory copy, replacing the mix's per-kind values (failures that take every replica "
           "of a shard fall back regardless)", FLEET),
    Option("--repair", "duration", "DUR", "mean time a failed node stays out (exponentially "
           "distributed), replacing the mix's per-kind values", FLEET),
    Option("--seeds", "int", "N", "independent replays of the run; intervals are over these "
           "(default 20)", FLEET),
    Option("--seed", "int", "S", "first random seed, for reproducible numbers (default 0)", FLEET),
    Option("--mix", "text", "KIND=W,...", _mix_help(), FLEET),
    Option("--rack-nodes", "int", "N", "nodes one rack-wide (correlated) event takes out (default 4)", FLEET),
    Option("--placement", "text", "HOW", "'spread': copies of a shard sit replica-nodes apart, so a "
           "rack-wide event hits different shards; 'packed': copies sit on adjacent nodes and can "
           "share a rack (default spread)", FLEET),
] + SHARDED_OPTIONS
_NOT_FLEET_FIELDS = ("gpus", "preset", "afr", "seeds", "seed", "mix", *_OVERRIDES, *SHARDED_DESTS)


def parse_mix(spec) -> tuple[FailureKind, ...]:
    """'gpu=3,software=1', or from a config file a table {kind: weight} or {kind: {field: value}}
    (fields: weight, detect, repair, correlated, destroys_state). Known kinds start from their
    defaults; a new kind must give detect and repair."""
    defaults = {k.name: k for k in DEFAULT_MIX}
    if isinstance(spec, str):
        items = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, sep, weight = part.partition("=")
            if not sep:
                raise ConfigError(f"--mix: write KIND=WEIGHT pairs, e.g. gpu=3,software=1 (got {part!r})")
            items[name.strip()] = weight
        spec = items
    if not isinstance(spec, dict) or not spec:
        raise ConfigError("mix: give at least one KIND=WEIGHT")
    mix = []
    for name, given in spec.items():
        fields = given if isinstance(given, dict) else {"weight": given}
        unknown = set(fields) - {"weight", "detect", "repair", "correlated", "destroys_state"}
        if unknown:
            raise ConfigError(f"mix kind {name}: unknown field(s) {', '.join(sorted(unknown))}")
        base = defaults.get(name)
        if base is None and not {"detect", "repair"} <= set(fields):
            raise ConfigError(f"mix: unknown kind {name!r}; known kinds are {', '.join(defaults)} "
                              f"(a new kind needs weight, detect and repair)")
        base = base or FailureKind(name, 0.0, 0.0, 0.0, 0.0, 0.0, "user-defined")
        try:
            kind = dataclasses.replace(
                base,
                weight=float(fields.get("weight", base.weight)),
                detect_h=parse_duration(fields["detect"], f"mix {name} detect") if "detect" in fields else base.detect_h,
                repair_h=parse_duration(fields["repair"], f"mix {name} repair") if "repair" in fields else base.repair_h,
                correlated=float(fields.get("correlated", base.correlated)),
                destroys_state=float(fields.get("destroys_state", base.destroys_state)))
        except ValueError as e:
            raise ConfigError(f"mix kind {name}: {e}") from None
        mix.append(kind)
    return tuple(mix)


def build(args: argparse.Namespace):
    """Parsed flags and config file -> (FleetConfig, rate label, seeds, seed)."""
    from hotspare.sim.fleet import FleetConfig

    raw = gather(args, OPTIONS)
    mix_spec = raw.pop("mix", None)
    vals = values(raw, OPTIONS, allow_multi=False)
    mix = parse_mix(mix_spec) if mix_spec is not None else DEFAULT_MIX
    for flag, field in _OVERRIDES.items():
        if flag in vals:
            mix = tuple(dataclasses.replace(k, **{field: vals[flag][0]}) for k in mix)
    (afr, label), = rates(vals)
    fields = job_fields(vals, skip=_NOT_FLEET_FIELDS)
    cfg = FleetConfig(gpus=vals["gpus"][0], afr=afr, mix=mix, **fields)
    seeds = vals.get("seeds", [20])[0]
    if seeds < 2:
        raise ConfigError(f"--seeds must be at least 2 to give a confidence interval (got {seeds})")
    return cfg, label, seeds, vals.get("seed", [0])[0]


def _plot_sizes(text: str | None, cfg) -> list[int]:
    if text is None:
        sizes = {n for n in (512, 1024, 2048, 4096, 8192, 16384)
                 if n % (cfg.gpus_per_node * cfg.replica_nodes) == 0} | {cfg.gpus}
        return sorted(sizes)
    opt = Option("--plot-sizes", "int", "N", "", FLEET)
    return sorted({convert(opt, part) for part in text.split(",")})


def _ci(stat: dict, fmt) -> str:
    return f"{fmt(stat['mean'])} ± {fmt(stat['ci'])}"


_POLICIES = (("checkpoint", "checkpoint-restart"), ("hotspare", "dedicated spares"),
             ("borrow", "borrowed"), ("shrink", "shrink"))


def render(cfg, label: str, result) -> str:
    s, plan = result.summary(), result.plan
    pct = lambda x: f"{100 * x:.2f}%"      # noqa: E731
    num = lambda x: f"{x:,.1f}"            # noqa: E731
    big = lambda x: f"{x:,.0f}"            # noqa: E731
    copies = cfg.nodes // cfg.replica_nodes
    shown = [(key, name) for key, name in _POLICIES if key in s]
    closed = {"checkpoint": plan.checkpoint, "hotspare": plan.hotspare, "borrow": plan.borrowed.outcome,
              "shrink": plan.shrunk.outcome if plan.shrunk else None}

    def each(stat_key: str, fmt, live_only: bool = False) -> list[str]:
        return ["-" if live_only and key == "checkpoint" else _ci(s[key][stat_key], fmt) for key, _ in shown]
    rows = [
        ("goodput", each("goodput", pct)),
        ("  closed form (hotspare plan)", [pct(closed[key].goodput) for key, _ in shown]),
        ("failures / run", [_ci(s["checkpoint"]["failures"], num)] + ["same failures"] * (len(shown) - 1)),
        ("hours down / run", each("downtime_hours", num)),
        ("recomputed GPU-hours / run", each("recomputed_gpu_hours", big)),
        ("USD wasted / year", each("wasted_usd_year", fmt_usd)),
        ("spares or lenders / year", each("cost_usd_year", fmt_usd, live_only=True)),
        ("net saving / year", each("net_saving_usd_year", fmt_usd, live_only=True)),
        ("  closed form (hotspare plan)", ["-", fmt_usd(plan.net_saving_usd_year),
                                           fmt_usd(plan.borrowed.net_saving_usd_year)]
         + ([fmt_usd(plan.shrunk.net_saving_usd_year)] if plan.shrunk else [])),
        ("recovered, no step lost", [pct(s[key]["zero_loss_share"]) for key, _ in shown]),
        ("spare pool short / run", each("pool_short_events", lambda x: f"{x:.2f}", live_only=True)),
    ]
    paths = "; ".join(f"{name}: " + ", ".join(f"{k} {v:,}" for k, v in sorted(s[key]["paths"].items()))
                      for key, name in shown[1:])
    notes = [f"dedicated spares: {result.spares} idle warm spare node(s)",
             f"borrowed: {result.lendable} node(s) of preemptible work to borrow from, lenders lose "
             f"{_ci(s['borrow']['lender_gpu_hours_year'], big)} GPU-hours/yr (closed form "
             f"{plan.borrowed.lender_gpu_hours_year:,.0f})" if "borrow" in s else ""]
    if "shrink" in s:
        notes.append(f"shrink: {_ci(s['shrink']['degraded'], pct)} of the copies down for repair on "
                     f"average (closed form {pct(plan.shrunk.degraded)})")
    else:
        notes.append("shrink: not possible with one copy of the state")
    lines = [
        f"hotspare simulate: {cfg.gpus:,} GPUs ({cfg.nodes:,} nodes, {copies} copies of the state, "
        f"{cfg.placement}) for {cfg.days:g} days, {s['seeds']} seeds",
        *textwrap.wrap(f"failure rate {cfg.afr:.2%}/GPU-year ({describe_rate(label)}); "
                       f"${cfg.price:.2f}/GPU-hour; live failover with dedicated spares, borrowed "
                       f"ones, or shrinking", 100),
        "",
        f"  {'':<28}" + "".join(f"{name:>19}" for _, name in shown),
        *[f"  {name:<28}" + "".join(f"{c:>19}" for c in cells) for name, cells in rows],
        "",
        *[line for note in notes if note for line in textwrap.wrap(
            note, 100, initial_indent="  ", subsequent_indent="    ")],
        *textwrap.wrap(f"live-failover recovery paths over all seeds (from plan_recovery): {paths}",
                       100, initial_indent="  ", subsequent_indent="    "),
        "",
        *textwrap.wrap(f"± is the {s['level']:.0%} confidence half-width over seeds (Student t). "
                       f"Intervals: checkpoint {fmt_duration(plan.checkpoint.interval)}, live-failover "
                       f"fallback checkpoints {fmt_duration(plan.hotspare.interval)}. The closed form "
                       f"folds the mix into averages (detect {fmt_duration(plan.inputs.detect)}, "
                       f"fallback {plan.inputs.fallback:.1%}) and ignores rack-wide events.", 100),
    ]
    return "\n".join(lines)


EPILOG = """\
examples:
  hotspare simulate --gpus 16384 --days 30 --preset llama3-405b
      a Llama-3-sized job for a month, 20 seeds, every policy, in about a second
  hotspare simulate --gpus 2048 --days 365 --preset llama3-405b --plot docs/economics-example.png
      a year on 2,048 GPUs, and the figure of docs/ECONOMICS.md
  hotspare simulate --gpus 1024 --replica-nodes 64 --placement packed --mix network=1
      only two copies of the state, packed into racks: watch rack-wide events force fallbacks
  hotspare simulate --gpus 2048 --days 365 --sharded fsdp --buddy-jump 4
      an FSDP job with buddy snapshots a rack away: the share of failures that fall back to a
      checkpoint, and which simultaneous losses recover from memory

Every failure of the live-failover replay is decided by the coordinator's own recovery policy
(hotspare.policy.recovery.plan_recovery): from memory when a copy of each lost shard survives,
waiting for cold nodes when the warm pool is empty, from a checkpoint when no copy is left.
Durations take a unit (90s, 2m, 1.5h, 3d). Model and sources: docs/ECONOMICS.md.
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "simulate", help="replay failures on a fleet under checkpoint-restart and live failover",
        description="Discrete-event replay of a job's failures (per-kind detection and repair,\n"
                    "rack-wide events, a finite warm-spare pool) under both recovery policies,\n"
                    "with confidence intervals over seeds and the closed form alongside.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, OPTIONS, allow_multi=False)
    parser.add_argument("--plot", metavar="PNG", type=Path,
                        help="also draw goodput vs. job size for both policies and the cumulative "
                             "waste of this run (needs matplotlib)")
    parser.add_argument("--plot-sizes", metavar="N,N,...",
                        help="job sizes in GPUs for the goodput panel (default 512 ... 16384 and --gpus)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hotspare.sim.fleet import simulate

    try:
        cfg, label, seeds, seed = build(args)
        sharded = requested(args, OPTIONS)
        if sharded is not None:
            return run_sharded(cfg, label, seeds, seed, sharded, args.json)
        sizes = _plot_sizes(args.plot_sizes, cfg) if args.plot else []
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise ConfigError("--plot needs matplotlib (pip install matplotlib)")
        from hotspare.cli.progress import Progress
        # --plot replays the seeds at each of its sizes too: the bar counts every seed simulated
        with Progress("simulate", seeds * (1 + len(sizes)), unit="seeds") as bar:
            result = simulate(cfg, seeds, seed, record=args.plot is not None, progress=bar.advance)
            if args.plot:
                from hotspare.sim.plot import plot_economics
                plot_economics(result, sizes, seed, args.plot, progress=bar.advance)
    except ConfigError as e:
        print(f"hotspare simulate: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        body = {"config": dataclasses.asdict(cfg), "summary": result.summary(),
                "plan": plan_json(result.plan, label, None)}
        print(json.dumps(body, indent=2))
    else:
        print(render(cfg, label, result))
        if args.plot:
            print(f"\nwrote {args.plot}")
    return 0
