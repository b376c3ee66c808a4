"""A submitted job's flags, read with the typed configuration `hotspare run` uses (``RunConfig``).

A ``submit`` request names the script and its arguments, the job's shape (nodes, ranks per
node, spares) and ``run_args``: the job's other `hotspare run` flags. What runs must be what was
submitted, so ``run_args`` are flags and their values only: a ``--`` (which would start another
script's arguments), a stray positional (which would become the script), a flag the service owns
or a flag the typed config does not know is refused at submit with the reason. The service owns
what places or launches the job and what names files on the service's own host; the fault
plug-in's flags are refused unless the service runs with ``--allow-inject``.
"""
from __future__ import annotations

import argparse
from typing import Any

from hotspare.config import RunConfig, add_arguments, from_namespace
from hotspare.config.schema import options
from hotspare.errors import ConfigError

# field of RunConfig -> why the service sets it, not the job
OWNED: dict[str, str] = {
    "launch.nproc": "give the ranks per host as submit's --nproc-per-node (the request's nproc_per_node)",
    "capacity.spares": "give the spares as submit's --spares (the request's spares)",
    "launch.local_nodes": "the service's jobs run on its pool's hosts",
    "launch.master_addr": "the service starts each job's rendezvous store",
    "launch.master_port": "the service starts each job's rendezvous store",
    "launch.secret_file": "the service's secret is the job's",
    "launch.report": "the report is kept by the service (submit --wait --report FILE writes it on the client)",
    "launch.spawn": "each host's agent decides (hotspare agent --spawn)",
    "hosts.listen": "the service's --listen address is the job's",
    "hosts.remote_nodes": "give the hosts as submit's --nodes",
    "hosts.node_lease": "the service's --node-lease holds for every job",
    "hosts.lease_margin": "the service's --lease-margin holds for every job",
    "health.devices": "each host's agent says its device slots (hotspare agent --devices)",
    "health.health_db": "device health is kept in the service's database",
    "checkpoint.checkpoint_key": "the service's checkpoint key signs its jobs' checkpoints ($HOTSPARE_CHECKPOINT_KEY "
                                 "where the service and the agents run)",
}
INJECTING: dict[str, str] = {
    "faults.inject": "the fault plug-in needs `hotspare coordinator --allow-inject`",
    "faults.allow_inject": "the fault plug-in needs `hotspare coordinator --allow-inject`",
}


def _flags(fields: dict[str, str]) -> dict[str, str]:
    """Every command-line name of those fields -> why."""
    out = {}
    for path, _cls, f, opt in options(RunConfig):
        if path in fields:
            for name in opt.names(f.name):
                out[name] = fields[path]
    return out


OWNED_FLAGS, INJECTING_FLAGS = _flags(OWNED), _flags(INJECTING)


def refused_flags(run_args: list[str], allow_inject: bool) -> list[tuple[str, str]]:
    """(flag, why) of each flag in ``run_args`` the job may not set: the service's own, and
    the fault plug-in's where the service does not allow it. Matched by exact name, as
    ``parse`` takes them (no abbreviations)."""
    refused = []
    for token in run_args:
        name = token.split("=", 1)[0]
        why = OWNED_FLAGS.get(name) or (None if allow_inject else INJECTING_FLAGS.get(name))
        if why is not None and name not in {n for n, _ in refused}:
            refused.append((name, why))
    return refused


def parse(argv: list[str], prog: str = "hotspare submit") -> RunConfig:
    """``argv`` as `hotspare run` takes it, into the typed config (ConfigError: bad, unknown)."""
    parser = argparse.ArgumentParser(prog=prog, add_help=False, exit_on_error=False, allow_abbrev=False)
    add_arguments(parser, RunConfig)
    try:
        ns, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ConfigError(f"the job's flags: {e}") from None
    if unknown:
        raise ConfigError(f"the job's flags: unrecognized {' '.join(unknown)[:200]}")
    return from_namespace(RunConfig, ns)


def check_run_args(run_args: list[str], script: str, script_args: list[str], allow_inject: bool) -> RunConfig:
    """The job's own flags, checked: what runs is ``script`` with ``script_args`` and nothing
    else. The typed config they make (the script's place holds ``script``)."""
    if "--" in run_args:
        raise ConfigError("the job's flags hold '--': the script and its arguments go after submit's own '--' "
                          "(hotspare submit [FLAGS] -- SCRIPT [ARGS]), never among the flags")
    refused = refused_flags(run_args, allow_inject)
    if refused:
        raise ConfigError("the job's flags: " + "; ".join(f"{flag}: {why}" for flag, why in refused))
    cfg = parse([*run_args, "--", script, *script_args])
    if cfg.script != script or list(cfg.script_args) != list(script_args):
        raise ConfigError(f"the job's flags would change what runs (script {cfg.script[:200]!r}, not "
                          f"{script[:200]!r}): a value without its flag? give flags and their values only")
    return cfg


def run_config(request: dict[str, Any], listen_host: str, secret_file: str, allow_inject: bool = False) -> RunConfig:
    """The job's typed configuration from a ``submit`` request: its own flags (checked by
    ``check_run_args``), the world size, --elastic, and the service's part (the hosts are remote, the
    store binds the service's address, the service's secret)."""
    world = int(request["nodes"]) * int(request["nproc_per_node"])
    run_args = [str(a) for a in request["run_args"]]
    script, args = str(request["script"]), [str(a) for a in request["args"]]
    check_run_args(run_args, script, args, allow_inject)
    # --elastic MIN (the request's, checked at submit): the job runs over virtual ranks and may shrink
    elastic = ["--elastic", str(int(request["elastic"]))] if request.get("elastic") is not None else []
    return parse([*run_args, "--nproc", str(world), "--spares", str(int(request["spares"])),
                  "--local-nodes", "0", "--remote-nodes", str(int(request["nodes"])), "--listen", f"{listen_host}:0",
                  "--secret-file", secret_file, *elastic, "--", script, *args])
