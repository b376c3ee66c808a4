"""``hotspare plan``: closed-form failure odds, goodput and dollars for one job, in under a second.

The options are declared once, in ``OPTIONS``, so ``hotspare simulate`` (which takes the same job
description) and config files (same keys as the long flags) read them the same way.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import textwrap
from pathlib import Path

from hotspare.errors import ConfigError
from hotspare.sim.economics import Driver, Plan, PlanInputs, drivers, evaluate
from hotspare.sim.presets import DEFAULT_PRESET, PRESETS
from hotspare.sim.units import fmt_duration, fmt_usd, parse_duration, parse_fraction

_D = PlanInputs(gpus=1)   # defaults, for help texts


@dataclasses.dataclass(frozen=True)
class Option:
    flag: str
    kind: str        # int | float | money | duration | fraction | interval | spares | preset | text
    metavar: str
    help: str
    group: str
    multi: bool = False   # plan accepts a comma-separated list to compare

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


def _presets_help() -> str:
    return "; ".join(f"{p.name} = {p.per_gpu_year:.1%}/GPU-year ({p.summary})" for p in PRESETS.values())


JOB, RATE, CKPT, LIVE = "the job", "failure rate (pick one)", "checkpoint-restart", "hotspare live failover"
OPTIONS = [
    Option("--gpus", "int", "N", "GPUs in the job, e.g. 2048", JOB, multi=True),
    Option("--days", "float", "D", f"length of the run in days; per-run figures use it, per-year "
           f"figures assume the same job runs all year (default {_D.days:g})", JOB),
    Option("--gpus-per-node", "int", "G", f"GPUs per node; spares and failures come in whole nodes "
           f"(default {_D.gpus_per_node})", JOB),
    Option("--price", "money", "USD", f"what one GPU-hour costs you, in USD (default {_D.price:.2f})", JOB),
    Option("--step-time", "duration", "DUR", f"time of one training step; a live recovery redoes the "
           f"step in flight (default {fmt_duration(_D.step)})", JOB),
    Option("--preset", "preset", "NAME", f"published failure rate to use (default {DEFAULT_PRESET}): "
           f"{_presets_help()}", RATE, multi=True),
    Option("--afr", "fraction", "RATE", "failures per GPU-year, e.g. 1% or 0.17, instead of a preset; "
           "read as a Poisson rate, so P(>=1 failure) = 1 - exp(-AFR x GPUs x days / 365)", RATE, multi=True),
    Option("--stall", "duration", "DUR", f"how long training stops to take one checkpoint (default "
           f"{fmt_duration(_D.stall)}; with asynchronous checkpointing, the few seconds it still "
           f"blocks)", CKPT),
    Option("--interval", "interval", "DUR", "training time between checkpoints, or 'optimal': "
           "Daly's optimum for this failure rate, capped at 24h (default optimal)", CKPT),
    Option("--restart", "duration", "DUR", f"from detection to training again after a failure: "
           f"reschedule, start processes, load the checkpoint, warm up (default "
           f"{fmt_duration(_D.restart)})", CKPT),
    Option("--detect", "duration", "DUR", f"from the failure to noticing it, for both policies "
           f"(default {fmt_duration(_D.detect)}: the default failure mix, where a hang waits out a "
           f"10-minute watchdog)", JOB),
    Option("--downtime", "duration", "DUR", f"from detection to training again when a copy of the "
           f"state survives: re-form the group, send the state to the spare (default "
           f"{fmt_duration(_D.downtime)})", LIVE),
    Option("--overhead", "fraction", "FRAC", f"steady-state slowdown hotspare adds to every step, "
           f"e.g. 0.5% (default {_D.overhead:.0%})", LIVE),
    Option("--fallback", "fraction", "FRAC", f"share of failures that leave no in-memory copy and "
           f"fall back to a checkpoint (default {_D.fallback:.1%}: silent data corruption plus "
           f"job-wide software bugs in the default failure mix)", LIVE),
    Option("--hotspare-interval", "interval", "DUR", "training time between hotspare's own "
           "checkpoints (for fallbacks), or 'optimal' for the fallback rate (default optimal)", LIVE),
    Option("--spares", "spares", "N", "warm spare nodes kept idle for live failover, or 'auto': "
           "the fewest for which at most 1% of failures find the pool empty (default auto)", LIVE),
    Option("--repair", "duration", "DUR", f"node-hours one failure takes out of service before the "
           f"node can be a spare again (default {fmt_duration(_D.repair)}: the default failure mix)", LIVE),
    Option("--cold-start", "duration", "DUR", f"when no warm spare is left, time to bring a cold node "
           f"into the job (default {fmt_duration(_D.cold_start)})", LIVE),
]


def add_options(parser: argparse.ArgumentParser, options: list[Option], allow_multi: bool) -> None:
    groups: dict[str, argparse._ArgumentGroup] = {}
    for opt in options:
        group = groups.setdefault(opt.group, parser.add_argument_group(opt.group))
        metavar = f"{opt.metavar}[,{opt.metavar}...]" if opt.multi and allow_multi else opt.metavar
        group.add_argument(opt.flag, metavar=metavar, help=opt.help.replace("%", "%%"), default=None)
    parser.add_argument("--config", metavar="FILE", type=Path,
                        help="TOML (or YAML, with PyYAML installed) file whose keys are the long "
                             "flags without dashes, e.g. gpus = 2048, restart = \"45m\"; flags on "
                             "the command line win")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")


def load_config_file(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    if path.suffix == ".toml":
        import tomllib
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
    elif path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ModuleNotFoundError:
            raise ConfigError(f"{path}: reading YAML needs PyYAML (pip install pyyaml); "
                              f"or write the same keys as TOML") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
    else:
        raise ConfigError(f"{path}: config files must end in .toml, .yaml or .yml")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected key = value pairs at the top level")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def convert(opt: Option, raw) -> object:
    """One option's value (from a flag or a config file) in model units (hours, fractions)."""
    what = opt.flag
    text = str(raw).strip()
    if opt.kind == "int":
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{what}: cannot read {text!r} as a whole number") from None
    if opt.kind in ("float", "money"):
        try:
            return float(text.lstrip("$"))
        except ValueError:
            raise ConfigError(f"{what}: cannot read {text!r} as a number") from None
    if opt.kind == "duration":
        return parse_duration(text, what)
    if opt.kind == "fraction":
        return parse_fraction(text, what)
    if opt.kind == "interval":
        return None if text.lower() == "optimal" else parse_duration(text, what)
    if opt.kind == "spares":
        return None if text.lower() == "auto" else convert(dataclasses.replace(opt, kind="int"), text)
    if opt.kind == "preset" and text not in PRESETS:
        raise ConfigError(f"{what}: unknown preset {text!r}; choose one of {', '.join(PRESETS)}")
    return text   # preset or text


def gather(args: argparse.Namespace, options: list[Option]) -> dict:
    """Merge the config file and the flags into {dest: raw value}; flags win."""
    raw: dict = {}
    if args.config is not None:
        raw = load_config_file(args.config)
        unknown = sorted(set(raw) - {o.dest for o in options})
        if unknown:
            raise ConfigError(f"{args.config}: unknown key(s) {', '.join(unknown)}; keys are the long "
                              f"flags, e.g. {', '.join(sorted(o.dest for o in options)[:4])}")
    for opt in options:
        if getattr(args, opt.dest) is not None:
            raw[opt.dest] = getattr(args, opt.dest)
    return raw


def values(raw: dict, options: list[Option], allow_multi: bool) -> dict[str, list]:
    out: dict[str, list] = {}
    for opt in options:
        if opt.dest not in raw:
            continue
        given = raw[opt.dest]
        items = given if isinstance(given, list) else str(given).split(",") if opt.multi else [given]
        if len(items) > 1 and not (opt.multi and allow_multi):
            raise ConfigError(f"{opt.flag} takes one value here (got {given!r})")
        out[opt.dest] = [convert(opt, item) for item in items]
    if "preset" in out and "afr" in out:
        raise ConfigError("give either --preset or --afr, not both")
    if "gpus" not in out:
        raise ConfigError("say how big the job is, e.g. --gpus 2048")
    return out


def rates(vals: dict[str, list]) -> list[tuple[float, str]]:
    """(failures per GPU-year, label) for each preset or --afr value asked for."""
    if "afr" in vals:
        return [(a, f"AFR {a:.2%}") for a in vals["afr"]]
    return [(PRESETS[name].per_gpu_year, name) for name in vals.get("preset", [DEFAULT_PRESET])]


def job_fields(vals: dict[str, list], skip: tuple[str, ...] = ("gpus", "preset", "afr")) -> dict:
    """Single-valued options, renamed to the dataclass fields they set."""
    rename = {"step_time": "step"}
    return {rename.get(k, k): v[0] for k, v in vals.items() if k not in skip}


# ----------------------------------------------------------------------------- output


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, 100, initial_indent="  ", subsequent_indent="    ")


def _pct(x: float, digits: int = 2) -> str:
    return f"{x * 100:.{digits}f}%"


_DRIVER_FMT = {
    "afr": lambda v: f"{v:.1%}/GPU-yr", "overhead": lambda v: f"{v:.2%}", "fallback": lambda v: f"{v:.1%}",
}


def _driver_line(d: Driver) -> str:
    fmt = _DRIVER_FMT.get(d.name, fmt_duration)
    sides = []
    for value, saving in ((d.low, d.saving_low), (d.high, d.saving_high)):
        sides.append(f"{fmt(value):>13} -> {fmt_usd(saving) if saving is not None else 'impossible':>9}")
    return f"  {d.name.replace('_', '-'):<18}{sides[0]}   {sides[1]}"


def verdict(plan: Plan) -> str:
    cr, hs = plan.checkpoint, plan.hotspare
    gap = hs.goodput - cr.goodput
    if plan.net_saving_usd_year <= 0:
        if gap <= 0:
            why = (f"checkpoint-restart already keeps {_pct(cr.goodput)} of the time, more than live "
                   f"failover's {_pct(hs.goodput)} after its {plan.inputs.overhead:.1%} overhead")
        else:
            why = (f"live failover gains {gap * 100:.2f} points of goodput "
                   f"({fmt_usd(cr.wasted_usd_year - hs.wasted_usd_year)}/yr), less than the "
                   f"{fmt_usd(plan.spare_cost_usd_year)}/yr of idle spares")
        return f"Does not pay at these inputs: {why}. A tuned checkpoint setup is the cheaper answer here."
    share = plan.net_saving_usd_year / (plan.inputs.gpus * 8760 * plan.inputs.price or 1)
    text = (f"Live failover pays: {fmt_usd(plan.net_saving_usd_year)}/yr net of spares "
            f"({share:.1%} of the job's GPU bill), goodput {_pct(cr.goodput)} -> {_pct(hs.goodput)}.")
    if gap < 0.01:
        text += (f" The gap is under one point: a well-tuned checkpoint setup is nearly as good, "
                 f"and the answer hinges on the overhead staying below {plan.break_even_overhead:.2%}.")
    return text


def describe_rate(label: str) -> str:
    return f"{label}: {PRESETS[label].summary}" if label in PRESETS else "given with --afr"


def render(plan: Plan, rate_label: str, drv: list[Driver]) -> str:
    inp, cr, hs = plan.inputs, plan.checkpoint, plan.hotspare
    run = f"{inp.days:g} d"
    lines = [
        f"hotspare plan: {inp.gpus:,} GPUs ({inp.gpus / inp.gpus_per_node:,.0f} nodes) for {inp.days:g} days "
        f"at ${inp.price:.2f}/GPU-hour",
        f"failure rate: {inp.afr:.2%} per GPU-year ({describe_rate(rate_label)})",
        "",
        f"  P(at least one failure in {run})   {_pct(plan.p_any_failure, 1):>10}",
        f"  expected failures in {run}          {plan.expected_failures:>10.2f}",
        f"  job MTBF                           {fmt_duration(plan.mtbf):>10}",
        "",
        f"  {'':<30}{'checkpoint-restart':>20}{'live failover':>20}",
        f"  {'goodput':<30}{_pct(cr.goodput):>20}{_pct(hs.goodput):>20}",
        f"  {'checkpoint interval':<30}{fmt_duration(cr.interval):>20}{fmt_duration(hs.interval):>20}",
        f"  {'GPU-hours wasted / run':<30}{cr.wasted_gpu_hours_run:>20,.0f}{hs.wasted_gpu_hours_run:>20,.0f}",
        f"  {'GPU-hours wasted / year':<30}{cr.wasted_gpu_hours_year:>20,.0f}{hs.wasted_gpu_hours_year:>20,.0f}",
        f"  {'USD wasted / year':<30}{fmt_usd(cr.wasted_usd_year):>20}{fmt_usd(hs.wasted_usd_year):>20}",
        f"  {'idle warm spares / year':<30}{'-':>20}{fmt_usd(plan.spare_cost_usd_year):>20}",
        f"  {'net saving / year':<30}{'':>20}{fmt_usd(plan.net_saving_usd_year):>20}",
        "",
        *_wrap(f"intervals: checkpoint-restart {cr.interval_rule}; live failover {hs.interval_rule}"
               f"; its checkpoints only cover the {inp.fallback:.1%} of failures that fall back"),
        *_wrap(f"spares: {plan.spares} node(s) = {plan.spares * inp.gpus_per_node} GPUs; at most "
               f"{plan.pool_empty:.2%} of failures find the pool empty and wait "
               f"{fmt_duration(inp.cold_start)} for a cold node"),
        *_wrap(f"break-even overhead: live failover pays while its steady-state overhead stays below "
               f"{plan.break_even_overhead:.2%} (assumed {inp.overhead:.2%})"
               + ("; it cannot pay even at zero overhead" if plan.break_even_overhead <= 0 else "")),
        "",
        *textwrap.wrap(verdict(plan), 100),
        "",
        "What drives the answer (net saving per year with one input halved, then doubled):",
        *[_driver_line(d) for d in drv[:6]],
        "",
        *textwrap.wrap(f"Inputs: step {fmt_duration(inp.step)}, stall {fmt_duration(inp.stall)}, detect "
        f"{fmt_duration(inp.detect)}, restart {fmt_duration(inp.restart)}, live downtime "
        f"{fmt_duration(inp.downtime)}, overhead {inp.overhead:.2%}, fallback {inp.fallback:.1%}, "
        f"repair {fmt_duration(inp.repair)}, cold start {fmt_duration(inp.cold_start)}.", 100),
        "Model: Poisson failures; exact renewal goodput (Daly 2006) for both policies; see docs/ECONOMICS.md.",
    ]
    return "\n".join(lines)


def render_table(rows: list[tuple[str, Plan]]) -> str:
    head = (f"{'rate':<13}{'GPUs':>7}{'P(fail)':>9}{'fails':>8}{'MTBF':>9}{'ckpt tau':>10}{'G ckpt':>9}"
            f"{'G live':>9}{'spares':>7}{'saving/yr':>11}{'o_s max':>9}")
    lines = [head, "-" * len(head)]
    for label, p in rows:
        lines.append(
            f"{label:<13}{p.inputs.gpus:>7,}{_pct(p.p_any_failure, 1):>9}{p.expected_failures:>8.1f}"
            f"{fmt_duration(p.mtbf):>9}{fmt_duration(p.checkpoint.interval):>10}"
            f"{_pct(p.checkpoint.goodput, 1):>9}{_pct(p.hotspare.goodput, 1):>9}{p.spares:>7}"
            f"{fmt_usd(p.net_saving_usd_year):>11}{p.break_even_overhead:>9.1%}")
    inp = rows[0][1].inputs
    lines += ["", f"{inp.days:g}-day run at ${inp.price:.2f}/GPU-hour; P(fail): at least one failure in the "
              f"run; G: goodput; o_s max: break-even overhead. One job: drop the commas for details."]
    return "\n".join(lines)


def plan_json(plan: Plan, rate_label: str, drv: list[Driver] | None) -> dict:
    out = dataclasses.asdict(plan)
    out["rate"] = describe_rate(rate_label)
    out["units"] = "durations in hours, rates per hour, money in USD"
    if drv is not None:
        out["drivers"] = [dataclasses.asdict(d) for d in drv]
    return out


# ----------------------------------------------------------------------------- command

EPILOG = """\
examples:
  hotspare plan --gpus 1024 --days 30 --preset afr-1pct
      odds of a failure in a month, and whether live failover pays at a 1% AFR
  hotspare plan --gpus 2048 --preset meta-rsc1 --interval 2h --restart 45m --price 3.50
      your checkpoint setup against live failover on 2,048 GPUs
  hotspare plan --gpus 1024,2048,16384 --preset afr-1pct,llama3-405b,meta-rsc1
      one line per combination: the worked example of docs/ECONOMICS.md

Durations take a unit (90s, 2m, 1.5h, 3d); fractions take 1% or 0.01. Goodput is the share of
wall-clock time that becomes training progress that is never thrown away. The model, its
assumptions and its sources are in docs/ECONOMICS.md; 'hotspare simulate' checks it failure by
failure with per-kind detection, repair and rack-wide events.
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan", help="closed-form odds, goodput and dollars: does live failover pay for this job?",
        description="Answer from your own parameters, in under a second: how likely the job is to\n"
                    "fail, what checkpoint-restart costs, what live failover would save net of idle\n"
                    "spares, and which assumption decides the answer.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, OPTIONS, allow_multi=True)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        vals = values(gather(args, OPTIONS), OPTIONS, allow_multi=True)
        fields = job_fields(vals)
        rows = [(label, evaluate(PlanInputs(gpus=gpus, afr=afr, **fields)))
                for (afr, label), gpus in itertools.product(rates(vals), vals["gpus"])]
        drv = drivers(rows[0][1].inputs) if len(rows) == 1 else None
    except ConfigError as e:
        print(f"hotspare plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        body = [plan_json(p, label, drv) for label, p in rows]
        print(json.dumps(body[0] if len(body) == 1 else body, indent=2))
    elif drv is not None:
        print(render(rows[0][1], rows[0][0], drv))
    else:
        print(render_table(rows))
    return 0
