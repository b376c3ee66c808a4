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
from hotspare.sim.economics import Driver, Plan, PlanInputs, cheapest, drivers, evaluate
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
POOL = "live failover without idle spares: borrow from lower-priority work, or shrink"
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
    Option("--detect", "duration", "DUR", f"from the failure to noticing it, for every policy "
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
    Option("--replica-nodes", "int", "N", f"nodes that hold one full copy of the training state, e.g. "
           f"16 for TP8 x PP16 on 8-GPU nodes, 1 when each node holds a whole replica; the job has "
           f"nodes / N copies: a failure recovers from memory while another copy of each lost shard "
           f"survives (simulate), and shrinking drops a whole copy (default {_D.replica_nodes})", JOB),
    Option("--lendable", "fraction", "FRAC", f"lower-priority, preemptible work running on the same "
           f"pool, as a share of the job's nodes; 'borrow' takes a lost node's replacement from it "
           f"(default {_D.lendable_share:.0%}: evaluations and small experiments beside a large job, "
           f"an assumption)", POOL),
    Option("--lend-pause", "duration", "DUR", f"time a lender takes to stop at a step boundary and park "
           f"its state, which the borrower waits out on top of --downtime (default "
           f"{fmt_duration(_D.lend_pause)}: Kubernetes' default termination grace)", POOL),
    Option("--lend-resume", "duration", "DUR", f"time the lender needs to start again once the failed "
           f"node is repaired and handed back: requeue, restore, warm up (default "
           f"{fmt_duration(_D.lend_resume)})", POOL),
    Option("--lender-nodes", "int", "N", f"nodes of one lending job; a pausing lender stops on all of "
           f"them for the whole loan (default {_D.lender_nodes})", POOL),
    Option("--lender", "text", "HOW", f"'pause': the lender stops whole until its node comes back; "
           f"'shrink': an elastic lender gives up one node and keeps training (default {_D.lender})", POOL),
    Option("--lender-value", "fraction", "FRAC", f"what a GPU-hour of the lender's work is worth to you, "
           f"as a share of --price; its lost hours are charged at this (default {_D.lender_value:.0%})",
           POOL),
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
    rename = {"step_time": "step", "lendable": "lendable_share"}
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
        text = f"Live failover with dedicated spares does not pay at these inputs: {why}."
        if cheapest(plan)[1] <= 0:
            text += " A tuned checkpoint setup is the cheaper answer here."
        return text
    share = plan.net_saving_usd_year / (plan.inputs.gpus * 8760 * plan.inputs.price or 1)
    text = (f"Live failover with dedicated spares pays: {fmt_usd(plan.net_saving_usd_year)}/yr net of them "
            f"({share:.1%} of the job's GPU bill), goodput {_pct(cr.goodput)} -> {_pct(hs.goodput)}.")
    if gap < 0.01:
        text += (f" The gap is under one point: a well-tuned checkpoint setup is nearly as good, "
                 f"and the answer hinges on the overhead staying below {plan.break_even_overhead:.2%}.")
    return text


def describe_rate(label: str) -> str:
    return f"{label}: {PRESETS[label].summary}" if label in PRESETS else "given with --afr"


_COLUMNS = ("checkpoint-restart", "dedicated spares", "borrowed", "shrink")


def _policy_table(plan: Plan) -> list[str]:
    """One column per way of surviving failures; '-' where it does not apply."""
    cr, hs, bw, sh = plan.checkpoint, plan.hotspare, plan.borrowed, plan.shrunk
    outs = [cr, hs, bw.outcome, sh.outcome if sh else None]

    def row(name: str, cells) -> str:
        return f"  {name:<26}" + "".join(f"{c:>19}" for c in cells)

    def each(fmt) -> list[str]:
        return [fmt(o) if o is not None else "-" for o in outs]
    return [
        row("", _COLUMNS),
        row("goodput", each(lambda o: _pct(o.goodput))),
        row("checkpoint interval", each(lambda o: fmt_duration(o.interval))),
        row("GPU-hours wasted / run", each(lambda o: f"{o.wasted_gpu_hours_run:,.0f}")),
        row("GPU-hours wasted / year", each(lambda o: f"{o.wasted_gpu_hours_year:,.0f}")),
        row("USD wasted / year", each(lambda o: fmt_usd(o.wasted_usd_year))),
        row("spares or lenders / year", ["-", fmt_usd(plan.spare_cost_usd_year),
                                         fmt_usd(bw.lender_cost_usd_year), "-" if sh is None else "$0"]),
        row("net saving / year", ["", fmt_usd(plan.net_saving_usd_year), fmt_usd(bw.net_saving_usd_year),
                                  fmt_usd(sh.net_saving_usd_year) if sh else "-"]),
    ]


def _borrow_line(plan: Plan) -> str:
    inp, bw = plan.inputs, plan.borrowed
    lender = (f"{inp.lender_nodes}-node lenders that pause" if inp.lender == "pause"
              else f"elastic {inp.lender_nodes}-node lenders that shrink")
    return (f"borrowed: {bw.lendable} node(s) of preemptible work to borrow from ({inp.lendable_share:.0%} "
            f"of the job); {bw.no_lender:.2%} of failures find none and wait {fmt_duration(inp.cold_start)} "
            f"for a cold node; every other live recovery waits a {fmt_duration(inp.lend_pause)} lender "
            f"pause; {lender} lose {bw.lender_gpu_hours_year:,.0f} GPU-hours/yr (pause, the repair, "
            f"{fmt_duration(inp.lend_resume)} resume), charged at {inp.lender_value:.0%} of the price")


def _shrink_line(plan: Plan) -> str:
    inp, sh = plan.inputs, plan.shrunk
    if sh is None:
        return (f"shrink: impossible, the job holds one copy of its state ({inp.replica_nodes} "
                f"replica-nodes); nothing is left to train on when a node is lost")
    return (f"shrink: {sh.copies} copies of the state ({inp.replica_nodes} node(s) each); on average "
            f"{sh.degraded:.2%} of them are down for repair, so the job trains at {1 - sh.degraded:.1%} "
            f"speed, and each failure stops it twice (drop the copy, take it back)")


def _cheapest_line(plan: Plan) -> str:
    best, saving = cheapest(plan)
    if saving <= 0:
        return "Cheapest way to survive failures here: checkpoint-restart; no live policy saves money."
    return (f"Cheapest way to survive failures here: {best}, saving {fmt_usd(saving)}/yr against "
            f"checkpoint-restart.")


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
        *_policy_table(plan),
        "",
        *_wrap(f"intervals: checkpoint-restart {cr.interval_rule}; live failover {hs.interval_rule}"
               f"; its checkpoints only cover the {inp.fallback:.1%} of failures that fall back"),
        *_wrap(f"spares: {plan.spares} node(s) = {plan.spares * inp.gpus_per_node} GPUs; at most "
               f"{plan.pool_empty:.2%} of failures find the pool empty and wait "
               f"{fmt_duration(inp.cold_start)} for a cold node"),
        *_wrap(f"break-even overhead: live failover pays while its steady-state overhead stays below "
               f"{plan.break_even_overhead:.2%} (assumed {inp.overhead:.2%})"
               + ("; it cannot pay even at zero overhead" if plan.break_even_overhead <= 0 else "")),
        *_wrap(_borrow_line(plan)),
        *_wrap(_shrink_line(plan)),
        "",
        *textwrap.wrap(verdict(plan), 100),
        *textwrap.wrap(_cheapest_line(plan), 100),
        "",
        "What drives the answer (net saving per year with one input halved, then doubled):",
        *[_driver_line(d) for d in drv[:6]],
        "",
        *textwrap.wrap(f"Inputs: step {fmt_duration(inp.step)}, stall {fmt_duration(inp.stall)}, detect "
        f"{fmt_duration(inp.detect)}, restart {fmt_duration(inp.restart)}, live downtime "
        f"{fmt_duration(inp.downtime)}, overhead {inp.overhead:.2%}, fallback {inp.fallback:.1%}, "
        f"repair {fmt_duration(inp.repair)}, cold start {fmt_duration(inp.cold_start)}.", 100),
        "Model: Poisson failures; exact renewal goodput (Daly 2006) for every policy; see docs/ECONOMICS.md.",
    ]
    return "\n".join(lines)


def render_table(rows: list[tuple[str, Plan]]) -> str:
    head = (f"{'rate':<12}{'GPUs':>7}{'fails':>7}{'MTBF':>9}{'G ckpt':>8}{'G ded':>8}{'G borr':>8}"
            f"{'G shr':>8}{'spares':>7}{'net ded':>10}{'net borr':>10}{'net shr':>10}  cheapest")
    lines = [head, "-" * len(head)]
    for label, p in rows:
        sh = p.shrunk
        lines.append(
            f"{label:<12}{p.inputs.gpus:>7,}{p.expected_failures:>7.1f}{fmt_duration(p.mtbf):>9}"
            f"{_pct(p.checkpoint.goodput, 1):>8}{_pct(p.hotspare.goodput, 1):>8}"
            f"{_pct(p.borrowed.outcome.goodput, 1):>8}{_pct(sh.outcome.goodput, 1) if sh else '-':>8}"
            f"{p.spares:>7}{fmt_usd(p.net_saving_usd_year):>10}{fmt_usd(p.borrowed.net_saving_usd_year):>10}"
            f"{fmt_usd(sh.net_saving_usd_year) if sh else '-':>10}  {cheapest(p)[0]}")
    inp = rows[0][1].inputs
    lines += ["", *textwrap.wrap(
        f"{inp.days:g}-day run at ${inp.price:.2f}/GPU-hour; fails: expected failures in the run; G: goodput "
        f"under checkpoint-restart, dedicated idle spares, spares borrowed from preemptible work "
        f"({inp.lendable_share:.0%} of the job), and shrinking ({inp.replica_nodes} nodes per copy); "
        f"net: yearly saving against checkpoint-restart after spares or lenders. One job: drop the "
        f"commas for details.", 100)]
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
  hotspare plan --gpus 2048 --lendable 1% --lender-nodes 8 --replica-nodes 1
      dedicated spares, spares borrowed from scarce 8-node preemptible jobs, or shrinking
      one node at a time: which is cheapest

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
