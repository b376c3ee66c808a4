"""``hotspare submit``, ``status`` and ``cancel``: clients of the coordinator service."""
from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import time

from hotspare.cli.agent import COORDINATOR_ENV as ENV_COORDINATOR

SUBMIT = """\
Queue a training job with the coordinator service (`hotspare coordinator`). It is placed on
--nodes free hosts with --nproc-per-node ranks each, plus --spares warm spares on spare hosts
(`hotspare agent --spare`), and runs as `hotspare run` would: failover without rollback, the
same worker contract. The script must be at the same path on every host: the service does not
look for it on its own host (nor make --checkpoint-dir there); a missing script stops the job
when its workers start. Every flag of `hotspare run` that shapes a job is taken as it is there
(checkpoints, hang detection, capacity, the health vote, --telemetry-period and --admission
for its hosts' devices, --telemetry off for none); --secret-file is the service's secret,
--report with --wait writes the job's report. Those the service owns are refused, each with
its reason: the hosts and the launcher (--listen, --remote-nodes, --local-nodes,
--master-addr, --master-port, --devices, --spawn, --health-db, --node-lease, --lease-margin)
and its checkpoint key (--checkpoint-key). --inject and --allow-inject are refused unless the
service runs with --allow-inject. `hotspare cancel` of a running job stops it after a last
checkpoint to its --checkpoint-dir.

Priorities: --priority names the job's class (production=1000, research=100, best-effort=0; or
an integer); the default is research. Queued jobs are placed highest priority first. A job that
loses a rank with no idle spare left borrows a device from a running job of strictly lower
priority submitted --preemptible: that job is paused (a signed checkpoint to its
--checkpoint-dir, which --preemptible requires), queued again, and resumes from that
checkpoint, losing no step, when capacity returns. A lender submitted --elastic MIN_RANKS (a
script over job.virtual_ranks) that keeps at least MIN_RANKS ranks is not paused: it shrinks,
keeps training, and grows back on a host that is idle again."""

COMMON_EPILOG = """\
the coordinator and secret default to $HOTSPARE_COORDINATOR and $HOTSPARE_SECRET_FILE.
exit status: 0 done (submit --wait: the job finished); 1 the job stopped, or the service refused
or is unreachable; 2 bad command line."""

ENV_SECRET = "HOTSPARE_SECRET_FILE"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", default=os.environ.get(ENV_COORDINATOR), metavar="ADDR:PORT",
                   help="the service's --listen address (default $HOTSPARE_COORDINATOR)")
    p.add_argument("--secret-file", default=os.environ.get(ENV_SECRET), metavar="FILE",
                   help="the service's secret (default $HOTSPARE_SECRET_FILE)")


def register(sub: argparse._SubParsersAction) -> None:
    from hotspare.config import RunConfig, add_arguments
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("submit", help="queue a job with the coordinator service", description=SUBMIT,
                       epilog="example:\n  hotspare submit --nodes 2 --nproc-per-node 2 --spares 1 --wait "
                              "--report r.json -- train.py --steps 1000\n\n" + COMMON_EPILOG, formatter_class=fmt)
    p.add_argument("--coordinator", default=os.environ.get(ENV_COORDINATOR), metavar="ADDR:PORT",
                   help="the service's --listen address (default $HOTSPARE_COORDINATOR)")
    p.add_argument("--nodes", type=int, default=1, metavar="N", help="hosts the ranks run on, --nproc-per-node "
                                                                     "ranks on each (default 1)")
    p.add_argument("--wait", action="store_true", help="wait for the job to end (exit 0 only if it finished); "
                                                       "--report FILE then gets its JSON report")
    from hotspare.service.priority import CLASSES, DEFAULT_CLASS
    p.add_argument("--priority", default=DEFAULT_CLASS, metavar="CLASS",
                   help=f"{', '.join(f'{k} ({v})' for k, v in CLASSES.items())}, or an integer; higher runs first "
                        f"and may borrow from lower (default {DEFAULT_CLASS})")
    p.add_argument("--preemptible", action="store_true",
                   help="a job of higher priority may pause this one to borrow its devices (needs "
                        "--checkpoint-dir: it resumes from there, nothing lost)")
    add_arguments(p, RunConfig)        # the job's flags, as `hotspare run` takes them
    p.set_defaults(func=submit)
    s = sub.add_parser("status", help="jobs and hosts of the coordinator service",
                       description="List the service's jobs (or one, with its report) and its hosts.",
                       epilog=COMMON_EPILOG, formatter_class=fmt)
    _common(s)
    s.add_argument("job", nargs="?", help="one job's id (j1, j2, ...)")
    s.add_argument("--json", action="store_true", help="print the service's answer as JSON")
    s.add_argument("--report", metavar="FILE", help="with JOB: write its JSON report here (once it ended)")
    s.set_defaults(func=status)
    c = sub.add_parser("cancel", help="cancel a job of the coordinator service",
                       description="Stop a queued or running job; its workers are ended.",
                       epilog=COMMON_EPILOG, formatter_class=fmt)
    _common(c)
    c.add_argument("job", help="the job's id")
    c.set_defaults(func=cancel)


def request(cli: argparse.Namespace, command: str, **fields) -> dict:
    """One authenticated request to the service; its reply (LookupError: refused)."""
    from hotspare.errors import ConfigError, ProtocolError
    from hotspare.protocol import auth
    if not cli.coordinator or not cli.secret_file:
        raise ConfigError("name the service: --coordinator ADDR:PORT and --secret-file FILE (or "
                          f"${ENV_COORDINATOR} and ${ENV_SECRET})")
    token = auth.client_token(auth.load_secret(cli.secret_file))
    try:
        ch = auth.connect(cli.coordinator, auth.CLIENT, token, timeout=10.0, command=command, args=fields,
                          operator=f"{getpass.getuser()} pid {os.getpid()}")
    except OSError as e:
        raise LookupError(f"cannot reach the coordinator service at {cli.coordinator}: {e}") from None
    try:
        ch.sock.settimeout(15.0)
        reply = ch.recv(any_version=True)     # a refusal of a service of another version, too
    except (OSError, ProtocolError) as e:
        raise LookupError(f"the service did not answer: {e}") from None
    finally:
        ch.close()
    if reply is not None and reply["type"] == "refused":
        raise LookupError(f"refused: {reply['message']}")
    if reply is None or reply["type"] != "control_reply":
        raise LookupError("the service closed the connection without answering")
    if not reply["ok"]:
        raise LookupError(f"refused: {reply['message']}")
    return reply


def _run(name: str, body) -> int:
    from hotspare.errors import ConfigError, ProtocolError
    try:
        return body()
    except ConfigError as e:
        print(f"hotspare {name}: error: {e}", file=sys.stderr)
        return 2
    except (LookupError, ProtocolError) as e:
        print(f"hotspare {name}: {e}", file=sys.stderr)
        return 1


def job_request(args: argparse.Namespace) -> dict:
    """What `submit` asks of the service: the script, the shape of the job, and its other
    `hotspare run` flags (those naming hosts or the launcher are the service's)."""
    import dataclasses

    from hotspare.config import RunConfig, from_namespace, to_argv
    from hotspare.errors import ConfigError
    from hotspare.service.jobargs import refused_flags
    cfg = from_namespace(RunConfig, argparse.Namespace(**{**vars(args), "launch.secret_file": None}))
    if not 1 <= args.nodes <= 4096:
        raise ConfigError(f"--nodes {args.nodes}: give 1..4096")
    # submit's own (--nproc-per-node, --spares, --report, --secret-file) are not the job's flags
    rest = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, nproc=1, report=None, secret_file=None),
                               capacity=dataclasses.replace(cfg.capacity, spares=1, elastic=None))
    argv = to_argv(rest)
    run_args = argv[:argv.index("--")] if "--" in argv else argv
    # the service checks them again (and the fault plug-in's, which it may allow)
    refused = refused_flags(run_args, allow_inject=True)
    if refused:
        raise ConfigError("; ".join(f"{flag}: {why}" for flag, why in refused))
    from hotspare.service.priority import check_elastic, parse_priority
    try:
        priority = parse_priority(args.priority)
        check_elastic(cfg.capacity.elastic, args.nodes * cfg.launch.nproc)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.preemptible and not cfg.checkpoint.checkpoint_dir:
        raise ConfigError("--preemptible needs --checkpoint-dir: a job paused to lend its devices keeps its state "
                          "there")
    return {"script": os.path.abspath(cfg.script), "args": list(cfg.script_args), "nodes": args.nodes,
            "nproc_per_node": cfg.launch.nproc, "spares": cfg.capacity.spares, "run_args": run_args,
            "priority": priority, "preemptible": bool(args.preemptible), "elastic": cfg.capacity.elastic}


def submit(args: argparse.Namespace) -> int:
    def body() -> int:
        args.secret_file = getattr(args, "launch.secret_file") or os.environ.get(ENV_SECRET)
        reply = request(args, "submit", **job_request(args))
        job = reply["job"]
        print(f"hotspare submit: {job} queued", flush=True)
        args.report = getattr(args, "launch.report")
        return _wait(args, job) if args.wait else 0
    return _run("submit", body)


def _wait(args: argparse.Namespace, job: str) -> int:
    last = None
    while True:
        reply = request(args, "status", job=job)
        row = reply["jobs"][0]
        if row["state"] != last:
            where = row["placement"] or {}
            extra = f" on {', '.join(where.get('hosts', []))}" if row["state"] == "running" else ""
            print(f"hotspare submit: {job} {row['state']}{extra}", flush=True)
            last = row["state"]
        if row["state"] in ("finished", "stopped", "cancelled"):
            if args.report and reply["report"] is not None:
                with open(args.report, "w") as f:
                    json.dump(reply["report"], f, indent=2)
            if row["message"]:
                print(f"hotspare submit: {row['message'].splitlines()[0]}", flush=True)
            return 0 if row["state"] == "finished" else 1
        time.sleep(1.0)


def status(args: argparse.Namespace) -> int:
    def body() -> int:
        reply = request(args, "status", **({"job": args.job} if args.job else {}))
        if args.report and args.job and reply["report"] is not None:
            with open(args.report, "w") as f:
                json.dump(reply["report"], f, indent=2)
        if args.json:
            print(json.dumps({"jobs": reply["jobs"], "hosts": reply["hosts"]}, indent=2))
            return 0
        print(f"{'JOB':<6} {'STATE':<10} {'NODES':>5} {'PER':>4} {'SPARES':>6}  {'PRIORITY':<24} HOSTS / MESSAGE")
        for j in reply["jobs"]:
            where = j["placement"] or {}
            hosts = ",".join(where.get("hosts", [])) + (f" +spares {','.join(where['spare_hosts'])}"
                                                         if where.get("spare_hosts") else "")
            print(f"{j['id']:<6} {j['state']:<10} {j['nodes']:>5} {j['nproc_per_node']:>4} {j['spares']:>6}  "
                  f"{_policy(j):<24} {hosts or '-'}" + (f"  {j['message'].splitlines()[0]}" if j["message"] else ""))
        print(f"\n{'HOST':<16} {'SLOTS':>5} {'SPARE':>5}  STATE")
        for h in reply["hosts"]:
            out = h.get("out_of_service") or {}
            print(f"{h['name']:<16} {len(h['devices']):>5} {'yes' if h['spare'] else 'no':>5}  {h['state']}"
                  + (f"  out of service: {', '.join(f'{d} ({state})' for d, state in out.items())}" if out else ""))
        return 0
    return _run("status", body)


def _policy(job: dict) -> str:
    """A status row's priority and policy (a service older than priorities sends none)."""
    if "priority" not in job:
        return "-"
    parts = [str(job.get("priority_class", job["priority"]))]
    parts += ["preemptible"] if job.get("preemptible") else []
    parts += [f"elastic>={job['elastic']}"] if job.get("elastic") is not None else []
    parts += [f"paused x{job['pauses']}"] if job.get("pauses") else []
    return ",".join(parts)


def cancel(args: argparse.Namespace) -> int:
    def body() -> int:
        print(f"hotspare cancel: {request(args, 'cancel', job=args.job)['message']}")
        return 0
    return _run("cancel", body)
