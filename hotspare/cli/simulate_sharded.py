"""``hotspare simulate --sharded``: which failures of an FSDP / HSDP job fall back to a checkpoint.

The options live here and are appended to ``hotspare simulate``'s; the job, rate and mix options
are shared. The decision per incident is ``hotspare.policy.recoverability.recover_shards``.
"""
from __future__ import annotations

import dataclasses
import json
import textwrap

from hotspare.cli.plan import Option, convert, gather
from hotspare.errors import ConfigError
from hotspare.sim.units import fmt_usd

SHARDED = "sharded jobs (FSDP / HSDP with buddy snapshots)"
SHARDED_OPTIONS = [
    Option("--sharded", "text", "MESH", "simulate a sharded job instead of a replicated one: 'fsdp' "
           "(one copy of the state, sharded over every GPU) or 'hsdp:R' (R replica groups, each "
           "sharded); prints which failures recover from memory and which fall back to a "
           "checkpoint, and the table of correlated losses for the placement (default: off)", SHARDED),
    Option("--buddy-jump", "int", "HOSTS", "hosts between a rank and the host that keeps its buddy "
           "snapshot, same local rank (NVRx's replication_jump in hosts); 0 turns buddy snapshots "
           "off; a jump of --rack-nodes puts the copy in another rack (default 1: the next host)",
           SHARDED),
    Option("--snapshot-in", "text", "PROC", "which process on the buddy host holds the snapshot: "
           "'agent' (outlives the buddy's worker) or 'worker' (lost with it) (default agent)", SHARDED),
    Option("--drain-share", "fraction", "FRAC", "share of single-GPU failures that health signals "
           "catch early enough to migrate while the rank's memory is still readable (default 0%)",
           SHARDED),
]
DESTS = tuple(o.dest for o in SHARDED_OPTIONS)
SOURCES = ("replica", "own", "buddy", "checkpoint")


def parse_mesh(text: str) -> int:
    """'fsdp' -> 1 replica group; 'hsdp:R' -> R."""
    spec = str(text).strip().lower()
    if spec == "fsdp":
        return 1
    kind, _, groups = spec.partition(":")
    if kind == "hsdp" and groups.isdigit() and int(groups) >= 2:
        return int(groups)
    raise ConfigError(f"--sharded: write 'fsdp' or 'hsdp:R' with R >= 2 replica groups (got {text!r})")


def requested(args, options) -> dict | None:
    """The sharded options given (flags or config file), or None when --sharded is not."""
    raw = gather(args, options)
    given = {k: raw[k] for k in DESTS if k in raw}
    if "sharded" not in given:
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            raise ConfigError(f"{flags} only apply with --sharded fsdp or --sharded hsdp:R")
        return None
    if getattr(args, "plot", None) is not None:
        raise ConfigError("--plot draws the replicated job's policies; leave it out with --sharded")
    by_dest = {o.dest: o for o in SHARDED_OPTIONS}
    return {k: convert(by_dest[k], v) for k, v in given.items()}


def build_sharded(fleet_cfg, opts: dict):
    from hotspare.sim.sharded import ShardedConfig
    common = {f.name: getattr(fleet_cfg, f.name) for f in dataclasses.fields(fleet_cfg)}
    replicate = parse_mesh(opts["sharded"])
    if fleet_cfg.nodes % replicate == 0:      # one copy of the state spans a replica group's hosts
        common["replica_nodes"] = max(1, fleet_cfg.nodes // replicate)
    snapshot_in = str(opts.get("snapshot_in", "agent")).strip().lower()
    cfg = ShardedConfig(**common, replicate=replicate,
                        buddy_jump=opts.get("buddy_jump", 1), snapshot_in=snapshot_in,
                        drain_share=opts.get("drain_share", 0.0))
    cfg.validate()
    return cfg


def _pct(stat: dict) -> str:
    return f"{100 * stat['mean']:.2f}% ± {100 * stat['ci']:.2f}%"


def render(cfg, label: str, result, combos, plan) -> str:
    s, mesh = result.summary(), cfg.mesh()
    kind = "FSDP" if mesh.replicate == 1 else f"HSDP, {mesh.replicate} replica groups of {mesh.shard}"
    buddies = (f"buddy snapshots {cfg.buddy_jump} host(s) on, held by the {cfg.snapshot_in}"
               if mesh.buddies and mesh.hosts > 1 else "no buddy snapshots")
    src = ", ".join(f"{k} {v:,}" for k, v in sorted(s["rank_sources"].items()))
    lines = [
        *textwrap.wrap(f"hotspare simulate --sharded: {kind}; {cfg.gpus:,} ranks on {mesh.hosts:,} hosts "
                       f"of {mesh.ranks_per_host}; {buddies}", 100),
        *textwrap.wrap(f"{cfg.days:g} days at {cfg.afr:.2%}/GPU-year ({label}), {s['seeds']} seeds; a "
                       f"failure that arrives during another's recovery counts as simultaneous", 100),
        "",
        f"  failures / run                                  {s['failures']:>12,.1f}",
        f"  fall back to a checkpoint                       {_pct(s['fallback_share']):>18}",
        f"    state destroyed (SDC, job-wide bug)           {_pct(s['destroyed_share']):>18}",
        f"    no in-memory copy of some shard left          {_pct(s['no_copy_share']):>18}",
        *textwrap.wrap(f"lost ranks recovered from: {src}", 100, initial_indent="  ",
                       subsequent_indent="    "),
        *textwrap.wrap(f"with this fallback share, hotspare plan's closed form gives live failover "
                       f"(dedicated spares) {100 * plan.hotspare.goodput:.2f}% goodput against "
                       f"checkpoint-restart's {100 * plan.checkpoint.goodput:.2f}%, net "
                       f"{fmt_usd(plan.net_saving_usd_year)}/yr",
                       100, initial_indent="  ", subsequent_indent="    "),
        "",
        "Which losses recover from memory with this placement (recover_shards):",
    ]
    for name, decision in combos:
        counts = ", ".join(f"{k} {decision.count(k)}" for k in SOURCES if decision.count(k))
        lines.append(f"  {name:<52} {decision.path:<11} {counts}")
    lines += ["", *textwrap.wrap("Scope: gpu, hbm_ecc, software, hang and sdc failures take one rank "
                                 "(host RAM and agent live on); network, nic, host and unknown kinds "
                                 "take the whole host; rack-wide events take --rack-nodes hosts. "
                                 "See docs/ECONOMICS.md, 'Sharded jobs'.", 100)]
    return "\n".join(lines)


def run_sharded(cfg_fleet, label: str, seeds: int, seed: int, opts: dict, as_json: bool) -> int:
    from hotspare.sim.economics import evaluate
    from hotspare.sim.sharded import combinations, simulate_sharded

    cfg = build_sharded(cfg_fleet, opts)
    result = simulate_sharded(cfg, seeds, seed)
    combos = combinations(cfg.mesh(), cfg.rack_nodes)
    fallback = result.summary()["fallback_share"]["mean"]
    plan = evaluate(dataclasses.replace(cfg.plan_inputs(), fallback=fallback))
    if as_json:
        body = {"config": dataclasses.asdict(cfg), "summary": result.summary(),
                "combinations": [{"case": n, "path": d.path, "reason": d.reason,
                                  "sources": {k: d.count(k) for k in SOURCES}}
                                 for n, d in combos],
                "closed_form_with_this_fallback": {"checkpoint_goodput": plan.checkpoint.goodput,
                                                   "hotspare_goodput": plan.hotspare.goodput,
                                                   "net_saving_usd_year": plan.net_saving_usd_year}}
        print(json.dumps(body, indent=2))
    else:
        print(render(cfg, label, result, combos, plan))
    return 0
