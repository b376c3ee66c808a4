"""``hotspare events``: print a run's event stream, or follow it while the run goes on."""
from __future__ import annotations

import argparse
import json
import os
import sys

from hotspare.errors import ConfigError

DESCRIPTION = """\
Print the event stream of a `hotspare run` (one versioned JSON record per line, written beside
its --report as REPORT.events.jsonl, or where --events put it): failures, failovers, recoveries
with their downtime by phase, generations, migrations, device states, the spare pool, worker
starts and exits. --follow prints records as the run writes them and ends with the run.

--dashboard ADDR:PORT reads the stream a dashboard serves instead of a file: the coordinator
service's (`hotspare coordinator --dashboard`: every job's records, each line prefixed with its
job, and the cluster's; --job J for one job's) or a run's (`hotspare run --dashboard`). It
proves the dashboard's token (derived from --secret-file, the service's or the run's secret, or
read from --token-file, the file the dashboard's log line names). Without --follow it prints the
records the dashboard keeps and ends; with it, it goes on until the job ends (--job, or a run's
dashboard), the service or run stops, or Ctrl-C, and says which on stderr.
docs/OBSERVABILITY.md describes the schema."""

EPILOG = """\
examples:
  hotspare run --nproc 4 --spares 1 --report r.json --inject kill:rank=2:step=60 -- examples/gpt_stdlib.py &
  hotspare events --follow r.json            # tails r.events.jsonl until the run ends
  hotspare events r.events.jsonl --json --kind recovered | jq .data.downtime_s

  # the coordinator service, started with --dashboard 10.0.0.1:8080:
  hotspare events --follow --dashboard 10.0.0.1:8080 --secret-file ~/.hotspare/secret --job j3
  hotspare events --follow --dashboard 10.0.0.1:8080 --secret-file ~/.hotspare/secret --kind failure --kind recovered

exit status: 0 the stream ended (the run or --job ended, the service stopped); 1 the connection to
the dashboard was lost; 2 an unreadable stream or a refused token; 130 Ctrl-C."""


def register(sub: argparse._SubParsersAction) -> None:
    from hotspare.cli.jobs import ENV_SECRET
    p = sub.add_parser("events", help="print or follow the event stream of a run or of the coordinator service",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", metavar="FILE", nargs="?",
                   help="the event stream (.jsonl), or the run's --report file (not with --dashboard)")
    p.add_argument("--follow", "-f", action="store_true", help="print records as they are written, until the run ends")
    p.add_argument("--json", action="store_true", help="print the records themselves, one JSON object a line")
    p.add_argument("--all", action="store_true", help="also every committed step and every telemetry poll")
    p.add_argument("--kind", action="append", metavar="KIND", help="only records of this kind (repeatable)")
    p.add_argument("--wait", type=float, default=60.0, metavar="SECONDS",
                   help="how long to wait for the stream to appear: the file, or the dashboard to answer (default 60)")
    g = p.add_argument_group("over the network: a dashboard's stream")
    g.add_argument("--dashboard", metavar="ADDR:PORT", default=None,
                   help="read the stream of the dashboard at ADDR:PORT (`hotspare coordinator --dashboard`, or "
                        "`hotspare run --dashboard`) instead of a file")
    g.add_argument("--job", metavar="JOB", default=None,
                   help="with the service's dashboard: only this job's records (j1, j2, ...); --follow ends with it")
    g.add_argument("--secret-file", metavar="FILE", default=None,
                   help=f"the service's (or run's) secret, from which the dashboard's token is derived (default "
                        f"${ENV_SECRET}, unless --token-file)")
    g.add_argument("--token-file", metavar="FILE", default=None,
                   help="the dashboard's token itself: the file its log line names")
    p.set_defaults(func=run)


def stream_path(path: str) -> str:
    """The event stream a path names: itself, or for a run's report, the stream beside it."""
    from hotspare.observe.stream import events_path_for
    if path.endswith(".jsonl"):
        return path
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                report = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: neither an event stream (.jsonl) nor a readable report ({e})") from None
        named = report.get("events_file") if isinstance(report, dict) else None
        if isinstance(named, str):
            return named if os.path.isabs(named) or os.path.exists(named) else \
                os.path.join(os.path.dirname(path), os.path.basename(named))
    return events_path_for(path)


def _token(args: argparse.Namespace) -> str:
    from hotspare.cli.jobs import ENV_SECRET
    from hotspare.observe.remote import read_token
    if args.token_file is not None:
        if args.secret_file is not None:
            raise ConfigError("give --secret-file or --token-file, not both")
        return read_token(args.token_file)
    secret_file = args.secret_file or os.environ.get(ENV_SECRET)
    if not secret_file:
        raise ConfigError("--dashboard needs the token: --secret-file FILE (the service's or run's secret; default "
                          f"${ENV_SECRET}) or --token-file FILE (the file the dashboard's log line names)")
    from hotspare.observe.dashboard import dashboard_token
    from hotspare.protocol import auth
    return dashboard_token(auth.load_secret(secret_file))


def _say(line: str) -> None:
    print(f"hotspare events: {line}", file=sys.stderr, flush=True)


def show(records, args: argparse.Namespace) -> None:
    """Print ``records`` as asked: each one's line (times relative to its run's start), or the
    record itself (--json); --kind and --all filter alike for a file and a dashboard."""
    from hotspare.observe import text
    starts: dict[object, float] = {}
    for rec in records:
        job = rec.get("job")
        if rec["kind"] == "run_start":
            starts[job] = rec["t"]
        if args.kind and rec["kind"] not in args.kind:
            continue
        if not (args.all or args.json or args.kind) and text.chatty(rec):
            continue
        if args.json:
            print(json.dumps(rec), flush=True)
        else:
            prefix = f"[{job}] " if job is not None and args.job is None else ""
            print(prefix + text.line(rec, starts.get(job)), flush=True)


def _from_dashboard(args: argparse.Namespace) -> int:
    from hotspare.observe.remote import DashboardStream
    stream = DashboardStream(args.dashboard, _token(args), job=args.job, live=args.follow, wait=args.wait, note=_say)
    try:
        show(stream.records(), args)
    finally:
        stream.close()
    if stream.skipped:
        _say(f"{stream.skipped} record(s) longer than the line limit were skipped")
    if stream.ended == "job":
        _say(f"job {args.job} ended" if args.job else "the run ended")
    elif stream.ended == "closed":
        _say(f"the dashboard at {args.dashboard} closed: its service (or run) stopped")
    elif stream.ended == "lost":
        _say(f"lost the dashboard at {args.dashboard}: {stream.reason}")
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    from hotspare.observe import stream
    try:
        if args.dashboard is not None:
            if args.path is not None:
                raise ConfigError(f"give a FILE or --dashboard ADDR:PORT, not both ({args.path})")
            return _from_dashboard(args)
        if args.path is None:
            raise ConfigError("give the event stream: a FILE, or --dashboard ADDR:PORT")
        if args.job is not None or args.secret_file is not None or args.token_file is not None:
            raise ConfigError("--job, --secret-file and --token-file go with --dashboard ADDR:PORT")
        path = stream_path(args.path)
        show(stream.follow(path, wait=args.wait) if args.follow else iter(stream.read(path)), args)
    except ConfigError as e:
        _say(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
    return 0
