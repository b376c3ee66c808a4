"""``hotspare inject``: send a fault to a running job (``hotspare run``, or a job of the
coordinator service), for drills and tests."""
from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
Send one fault to a running `hotspare run` job on this machine, one started with --allow-inject
(or --inject; any other job refuses it). The job's launcher validates it
(a bad spec is refused with a message and changes nothing) and arms it: it fires when the named
rank starts its next step, or at step=S when given. Device faults (thermal, ecc, xid) change what
the job's simulated telemetry reads, so the health service sees a degrading device."""

EPILOG = """\
examples:
  hotspare inject thermal:rank=1:temp=92        # the device under rank 1 overheats: live migration
  hotspare inject ecc:rank=2:kind=uncorrectable # failover from a healthy replica
  hotspare inject kill:rank=0                   # SIGKILL rank 0 at its next step
  hotspare inject --job 127.0.0.1:40123 corrupt:rank=3
  hotspare inject --coordinator 10.0.0.1:29400 --secret-file S --job j3 thermal:rank=2:temp=92

{grammar}

The job is found from its run file (~/.hotspare/runs/PID.json, or $HOTSPARE_RUN_DIR); with
several jobs running, name one with --job PID or --job HOST:PORT (its log prints `control:`).
The run file (yours only, 0600) also holds the token the job asks for; a job on another host,
or one whose run file you cannot read, needs the job's --secret-file. A job of the coordinator
service (`hotspare coordinator --allow-inject`, the job submitted with --allow-inject): give
--coordinator and the service's --secret-file (or $HOTSPARE_SECRET_FILE), and --job its id.
exit status: 0 armed; 1 refused by the job or no job reachable; 2 bad command line."""


def register(sub: argparse._SubParsersAction) -> None:
    from hotspare.testing.faults.grammar import GRAMMAR
    p = sub.add_parser("inject", help="send a fault to a running job (health drills, tests)",
                       description=DESCRIPTION, epilog=EPILOG.format(grammar=GRAMMAR),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", help="the fault, e.g. thermal:rank=1:temp=92 (grammar below)")
    p.add_argument("--job", metavar="PID|HOST:PORT", help="which running job (default: the only one)")
    p.add_argument("--secret-file", metavar="FILE",
                   help="the job's secret (the file given to its `hotspare run --secret-file`), when its run "
                        "file does not hold the token; with --coordinator, the service's")
    p.add_argument("--coordinator", metavar="ADDR:PORT",
                   help="the job is one of the coordinator service at ADDR:PORT; --job names it (j1, j2, ...)")
    p.set_defaults(func=run)


def _address(job: str | None) -> str:
    from hotspare.coordinator.control import run_dir, running_jobs
    if job and ":" in job:
        return job
    jobs = running_jobs()
    if job:
        match = [j for j in jobs if str(j["pid"]) == job]
        if not match:
            raise LookupError(f"no running hotspare job with launcher pid {job} (run files in {run_dir()})")
        return match[0]["control"]
    if not jobs:
        raise LookupError(f"no running hotspare job found (no live run file in {run_dir()}); start one "
                          "with `hotspare run`, or give --job HOST:PORT")
    if len(jobs) > 1:
        listing = "\n".join(f"  --job {j['pid']}   {j.get('script', '?')} ({j['control']})" for j in jobs)
        raise LookupError(f"{len(jobs)} jobs are running; pick one:\n{listing}")
    return jobs[0]["control"]


def _token(address: str, secret_file: str | None) -> str:
    from hotspare.coordinator.control import run_dir, token_for
    from hotspare.protocol import auth
    if secret_file:
        return auth.operator_token(auth.load_secret(secret_file))
    token = token_for(address)
    if token is None:
        raise LookupError(f"no run file in {run_dir()} holds the token of the job at {address}; give its "
                          "--secret-file")
    return token


def run(args: argparse.Namespace) -> int:
    from hotspare.testing.faults.grammar import parse
    from hotspare.coordinator.control import send
    from hotspare.errors import ConfigError, ProtocolError
    try:
        parse(args.spec, running=True)            # refuse a malformed spec before connecting
        if args.coordinator:
            return _service_job(args)
        address = _address(args.job)
        token = _token(address, args.secret_file)
    except ConfigError as e:
        print(f"hotspare inject: error: {e}", file=sys.stderr)
        return 2
    except LookupError as e:
        print(f"hotspare inject: {e}", file=sys.stderr)
        return 1
    try:
        reply = send(address, args.spec, token)
    except (LookupError, OSError, ProtocolError) as e:
        print(f"hotspare inject: {e}", file=sys.stderr)
        return 1
    print(("hotspare inject: " if reply["ok"] else "hotspare inject: refused: ") + reply["message"],
          file=sys.stdout if reply["ok"] else sys.stderr)
    return 0 if reply["ok"] else 1


def _service_job(args: argparse.Namespace) -> int:
    """The fault, through the coordinator service, to its job ``--job``."""
    import os

    from hotspare.cli.jobs import ENV_SECRET, request
    from hotspare.errors import ConfigError
    if not args.job:
        raise ConfigError("--coordinator needs --job JOB (the job's id, from `hotspare status`)")
    args.secret_file = args.secret_file or os.environ.get(ENV_SECRET)
    try:
        reply = request(args, "inject", job=args.job, spec=args.spec)
    except LookupError as e:
        print(f"hotspare inject: {e}", file=sys.stderr)
        return 1
    print(f"hotspare inject: {reply['message']}")
    return 0
