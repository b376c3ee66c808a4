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
docs/OBSERVABILITY.md describes the schema."""

EPILOG = """\
examples:
  hotspare run --nproc 4 --spares 1 --report r.json --inject kill:rank=2:step=60 -- examples/gpt_stdlib.py &
  hotspare events --follow r.json            # tails r.events.jsonl until the run ends
  hotspare events r.events.jsonl --json --kind recovered | jq .data.downtime_s"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("events", help="print or follow a run's event stream", description=DESCRIPTION,
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", metavar="FILE", help="the event stream (.jsonl), or the run's --report file")
    p.add_argument("--follow", "-f", action="store_true", help="print records as they are written, until the run ends")
    p.add_argument("--json", action="store_true", help="print the records themselves, one JSON object a line")
    p.add_argument("--all", action="store_true", help="also every committed step and every telemetry poll")
    p.add_argument("--kind", action="append", metavar="KIND", help="only records of this kind (repeatable)")
    p.add_argument("--wait", type=float, default=60.0, metavar="SECONDS",
                   help="--follow: how long to wait for the stream to appear (default 60)")
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


def run(args: argparse.Namespace) -> int:
    from hotspare.observe import stream, text
    try:
        path = stream_path(args.path)
        records = stream.follow(path, wait=args.wait) if args.follow else iter(stream.read(path))
        start = None
        for rec in records:
            if rec["kind"] == "run_start":
                start = rec["t"]
            if args.kind and rec["kind"] not in args.kind:
                continue
            if not (args.all or args.json or args.kind) and text.chatty(rec):
                continue
            print(json.dumps(rec) if args.json else text.line(rec, start), flush=True)
    except ConfigError as e:
        print(f"hotspare events: error: {e}", file=sys.stderr)
        return 2
    return 0
