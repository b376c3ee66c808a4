"""``hotspare coordinator``: the control plane of many hosts and jobs (docs/DEPLOY.md)."""
from __future__ import annotations

import argparse
import signal
import sys
import time

DESCRIPTION = """\
Run the coordinator service: node agents of every host register with it (`hotspare agent
--coordinator ADDR:PORT [--spare]`), `hotspare submit` queues jobs, and the service places
each job on free hosts, runs its coordinator (membership, generations, spares, failover) and
keeps everything it knows in an SQLite database in --state DIR, the health of every host's
devices too (`hotspare health --db DIR/coordinator.db` shows it; each job's hosts poll their
devices and run their checks, and placement uses only devices in service). Killed (even kill -9) and
started again with the same --state, it resumes the jobs that were running: their workers
train on meanwhile (the coordinator is needed only for membership changes), their agents
re-register, and a failure that happened while it was away is handled once it is back.

It checks its database before it uses it: a truncated or damaged file, a bad row, an empty
file (or a missing one with its backup beside it) stops it with exit status 2, naming the file
and the command that restores the backup it keeps (DIR/coordinator.db.backup, made at every
change of a job's state); it never starts as if it had no jobs. A host serves job after job:
it goes back to the pool once its agent has ended its part of the last one. `hotspare cancel`
is kept: a queued job never starts, a running one stops after a last checkpoint."""

EPILOG = """\
example (this host 10.0.0.1 on the cluster's private network; the same secret file everywhere):
  hotspare coordinator --listen 10.0.0.1:29400 --state /var/lib/hotspare --secret-file ~/.hotspare/secret
  hotspare agent --coordinator 10.0.0.1:29400 --secret-file ~/.hotspare/secret --devices cpu:2   # each host
  hotspare submit --coordinator 10.0.0.1:29400 --secret-file ~/.hotspare/secret \\
      --nodes 2 --nproc-per-node 2 --spares 1 --wait -- train.py
  hotspare status --coordinator 10.0.0.1:29400 --secret-file ~/.hotspare/secret

SIGTERM or SIGINT stops the service the way a crash would, only tidily: the running jobs train on
without it and are resumed when it is started again with the same --state.
exit status: 0 after SIGTERM / SIGINT; 2 for bad input or a database it must not start on."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coordinator", help="run the coordinator service of many hosts and jobs",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", required=True, metavar="ADDR:PORT",
                   help="where agents and clients connect: this host's address on the cluster's private network "
                        "(not 0.0.0.0); each job's rendezvous store listens on the same address")
    p.add_argument("--state", required=True, metavar="DIR", help="the service's database (made if missing)")
    p.add_argument("--secret-file", required=True, metavar="FILE",
                   help="the shared secret every agent and client proves (mode 0600, >= 32 characters)")
    p.add_argument("--node-lease", type=float, default=3.0, metavar="SECONDS",
                   help="a node whose renewals stop is lost after SECONDS + --lease-margin (default 3)")
    p.add_argument("--lease-margin", type=float, default=1.0, metavar="SECONDS",
                   help="the wait beyond the lease, time for a cut-off agent to fence itself (default 1)")
    p.add_argument("--metrics", metavar="ADDR:PORT", default=None,
                   help="serve Prometheus metrics of every job on http://ADDR:PORT/metrics, each series labelled "
                        "job_name (off by default; plain HTTP without authentication: never a wildcard; "
                        "docs/OBSERVABILITY.md)")
    p.add_argument("--dashboard", metavar="ADDR:PORT", default=None,
                   help="serve a live web dashboard of the cluster and its jobs on http://ADDR:PORT/ (off by default; "
                        "port 0: any free port, logged): hosts and devices by health state, with cordon, drain and "
                        "uncordon, each confirmed; log in with the token in the file the log names (derived from "
                        "--secret-file); never a wildcard (docs/OBSERVABILITY.md)")
    p.add_argument("--allow-inject", action="store_true",
                   help="jobs may load the fault plug-in (submit --inject / --allow-inject, then `hotspare inject "
                        "--coordinator ADDR:PORT --job JOB SPEC`): for drills and tests, never in production")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hotspare.config.run import host_port
    from hotspare.errors import ConfigError, HotspareError
    from hotspare.observe.service import ServiceWatch
    from hotspare.protocol import auth
    from hotspare.service.service import Service
    t0 = time.time()

    def log(line: str) -> None:
        print(f"[hotspare coordinator {time.time() - t0:7.2f}s] {line}", flush=True)

    try:
        host, port = host_port(args.listen)
        if host in ("0.0.0.0", "::", ""):
            raise ConfigError(f"--listen {args.listen}: give this host's address on the private network, not a "
                              "wildcard (the jobs' rendezvous stores are not authenticated)")
        if not 0 < args.node_lease <= 3600 or not 0 <= args.lease_margin <= 3600:
            raise ConfigError("--node-lease must be in (0, 3600] s and --lease-margin in [0, 3600] s")
        secret = auth.load_secret(args.secret_file)
        watch = ServiceWatch.start(args.metrics, args.dashboard, secret, log)
    except (ConfigError, HotspareError, OSError) as e:
        print(f"hotspare coordinator: error: {e}", file=sys.stderr)
        return 2
    try:
        service = Service(host, port, secret, args.secret_file, args.state,
                          lease=args.node_lease, margin=args.lease_margin, log=log, allow_inject=args.allow_inject,
                          observe=watch.install if watch else None)
    except (ConfigError, HotspareError, OSError) as e:      # a refused database says what to do
        print(f"hotspare coordinator: error: {e}", file=sys.stderr)
        if watch:
            watch.close()
        return 2
    if watch:
        watch.attach(service)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: service.stop())
    try:
        return service.serve()
    finally:
        if watch:
            watch.close()
