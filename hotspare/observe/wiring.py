"""How ``hotspare run`` turns observation on: ``--metrics ADDR:PORT`` (Prometheus ``/metrics``)
and ``--events FILE`` (the JSON-lines event stream; by default beside ``--report``). Without
either, nothing here runs and the coordinator has no extra listener."""
from __future__ import annotations

import argparse
from typing import Any, Callable

METRICS_HELP = ("serve Prometheus metrics on http://ADDR:PORT/metrics while the job runs (off by default; "
                "port 0: any free port, logged; plain HTTP without authentication, so give the address of the "
                "monitoring network, never a wildcard; docs/OBSERVABILITY.md lists the metrics)")
EVENTS_HELP = ("write the job's event stream (one versioned JSON record per line) to FILE; by default "
               "REPORT.events.jsonl beside --report REPORT.json, none without --report. "
               "`hotspare events --follow FILE` tails it")


def add_observe_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("observability (docs/OBSERVABILITY.md)")
    g.add_argument("--metrics", metavar="ADDR:PORT", default=None, help=METRICS_HELP)
    g.add_argument("--events", metavar="FILE", default=None, help=EVENTS_HELP)


def check_observe_arguments(args: argparse.Namespace) -> None:
    """ConfigError for a --metrics address that cannot be used, before anything starts."""
    if args.metrics is not None:
        from hotspare.observe.metrics import parse_address
        parse_address(args.metrics)


class Watch:
    """The observer of one run with its sinks; ``close`` writes the last records and stops them."""

    def __init__(self, observer, file, server, path: str | None):
        self.observer, self.file, self.server, self.path = observer, file, server, path

    def close(self, code: int | None, report: dict[str, Any]) -> None:
        if self.path is not None:
            report["events_file"] = self.path
        self.observer.close(code, report)
        if self.file is not None:
            self.file.close()
        if self.server is not None:
            self.server.close()


def observe(args: argparse.Namespace, report: str | None, coordinator, ledger, health,
            log: Callable[[str], None]) -> Watch | None:
    """The run's observer, installed on ``coordinator`` (None when neither flag asks for it);
    ConfigError for an address or file it cannot use."""
    from hotspare.observe.stream import events_path_for
    path = args.events or (events_path_for(report) if report else None)
    if args.metrics is None and path is None:
        return None
    from hotspare.observe.observer import Observer
    sinks, file, server = [], None, None
    if args.metrics is not None:
        from hotspare.observe.metrics import MetricsServer, RunMetrics, parse_address
        host, port = parse_address(args.metrics)
        metrics = RunMetrics()
        server = MetricsServer(metrics.registry, host, port)
        sinks.append(metrics.consume)
        log(f"metrics: http://{server.address}/metrics (Prometheus; docs/OBSERVABILITY.md)")
    if path is not None:
        from hotspare.observe.stream import EventFile
        try:
            file = EventFile(path)
        except Exception:
            if server is not None:
                server.close()
            raise
        sinks.append(file)
        log(f"events: {path} (hotspare events --follow {path})")
    observer = Observer(ledger, coordinator.view, sinks, health=health).install(coordinator)
    observer.start(ledger.settings)
    return Watch(observer, file, server, path)
