"""``hotspare report``: read a run's JSON report; ``--plot`` draws it."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

from hotspare.errors import ConfigError

DESCRIPTION = """\
Summarise the JSON report of a `hotspare run --report REPORT` (outcome, steps, each failure with
its recovery path, lost steps and downtime by phase). --plot OUT.png draws the loss curve with
each failure and its recovery marked (from the event stream beside the report,
REPORT.events.jsonl) and each failure's downtime by phase (needs matplotlib)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="summarise or plot a run's report", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", metavar="REPORT", help="the JSON file hotspare run --report wrote")
    p.add_argument("--plot", metavar="PNG", type=Path, help="draw the run into this PNG")
    p.add_argument("--events", metavar="FILE", help="the event stream (default: the one the report names, or "
                                                    "REPORT.events.jsonl beside it)")
    p.set_defaults(func=run)


def load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read the report {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not JSON ({e}); give the file hotspare run --report wrote") from None
    if not isinstance(report, dict) or "failures" not in report:
        raise ConfigError(f"{path} is not a hotspare run report (no 'failures')")
    return report


def summary(report: dict) -> list[str]:
    lines = [f"outcome {report.get('outcome')}: {report.get('steps_completed')}/{report.get('total_steps')} steps, "
             f"{report.get('failures_total')} failure(s), {report.get('recovered_zero_loss')} recovered with zero "
             f"lost steps, {report.get('steps_lost')} lost, {report.get('steps_repeated')} repeated, wall "
             f"{report.get('wall_time_s')} s, median step {report.get('median_step_time_s')} s"]
    for i, f in enumerate(report.get("failures") or [], 1):
        phases = ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in (f.get("phases_s") or {}).items()
                           if v is not None)
        down = f"{f['downtime_s']:.3f} s" if f.get("downtime_s") is not None else "not recovered"
        lines.append(f"  #{i} rank {f['rank']} {f['kind']} at step {f['step']}: {f.get('recovery_path')}, "
                     f"lost {f.get('lost_steps')}, downtime {down} ({phases})")
    return lines


def run(args: argparse.Namespace) -> int:
    from hotspare.cli.events import stream_path
    from hotspare.observe import stream
    try:
        report = load(args.report)
        for line in summary(report):
            print(line)
        if args.plot is None:
            return 0
        if importlib.util.find_spec("matplotlib") is None:
            raise ConfigError("--plot needs matplotlib (pip install 'hotspare[plot]')")
        path = args.events or stream_path(args.report)
        records = None
        if os.path.exists(path):
            records = stream.read(path)
        else:
            print(f"hotspare report: no event stream at {path}: the plot has no loss curve", file=sys.stderr)
        from hotspare.observe.plot import plot_run
        plot_run(report, records, args.plot)
        print(f"plot written to {args.plot}")
    except ConfigError as e:
        print(f"hotspare report: error: {e}", file=sys.stderr)
        return 2
    return 0
