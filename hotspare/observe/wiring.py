"""How ``hotspare run`` turns observation on: ``--metrics ADDR:PORT`` (Prometheus ``/metrics``),
``--events FILE`` (the JSON-lines event stream; by default beside ``--report``) and
``--dashboard ADDR:PORT`` (the live web page). Without any, nothing here runs and the
coordinator has no extra listener."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

METRICS_HELP = ("serve Prometheus metrics on http://ADDR:PORT/metrics while the job runs (off by default; "
                "port 0: any free port, logged; plain HTTP without authentication, so give the address of the "
                "monitoring network, never a wildcard; docs/OBSERVABILITY.md lists the metrics)")
DASHBOARD_HELP = ("serve a live, read-only web dashboard of the job on http://ADDR:PORT/ (off by default; port 0: any "
                  "free port, logged): devices by health state, ranks, the loss curve, failures and recoveries with "
                  "their downtime by phase. Log in with the token in the file the log names (derived from the job's "
                  "secret); never a wildcard address")
EVENTS_HELP = ("write the job's event stream (one versioned JSON record per line) to FILE; by default "
               "REPORT.events.jsonl beside --report REPORT.json, none without --report. "
               "`hotspare events --follow FILE` tails it")


def add_observe_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("observability (docs/OBSERVABILITY.md)")
    g.add_argument("--metrics", metavar="ADDR:PORT", default=None, help=METRICS_HELP)
    g.add_argument("--events", metavar="FILE", default=None, help=EVENTS_HELP)
    g.add_argument("--dashboard", metavar="ADDR:PORT", default=None, help=DASHBOARD_HELP)


def check_observe_arguments(args: argparse.Namespace) -> None:
    """ConfigError for a --metrics address that cannot be used, before anything starts."""
    from hotspare.observe.metrics import parse_address
    if args.metrics is not None:
        parse_address(args.metrics)
    if args.dashboard is not None:
        parse_address(args.dashboard, "--dashboard")


class Watch:
    """The observer of one run with its sinks; ``close`` writes the last records and stops them."""

    def __init__(self, observer, file, server, path: str | None, dashboard=None):
        self.observer, self.file, self.server, self.path, self.dashboard = observer, file, server, path, dashboard

    def close(self, code: int | None, report: dict[str, Any]) -> None:
        """Never raises: a part that cannot be closed (the stream's last flush on a full disk) is
        said on stderr, and the run still writes its report."""
        if self.path is not None:
            report["events_file"] = self.path
        self.observer.close(code, report)
        for name, part in (("event stream", self.file), ("metrics server", self.server),
                           ("dashboard", self.dashboard)):
            if part is None:
                continue
            try:
                part.close()
            except Exception as e:      # noqa: BLE001 - the run's report comes first
                print(f"hotspare: the {name} did not close cleanly: {type(e).__name__}: {e}", file=sys.stderr,
                      flush=True)
        if self.dashboard is not None:
            import shutil
            shutil.rmtree(self.dashboard.token_folder, ignore_errors=True)     # the token dies with the run


def observe(args: argparse.Namespace, report: str | None, coordinator, ledger, health,
            log: Callable[[str], None], secret: bytes = b"") -> Watch | None:
    """The run's observer, installed on ``coordinator`` (None when neither flag asks for it);
    ConfigError for an address or file it cannot use."""
    from hotspare.observe.stream import events_path_for
    path = args.events or (events_path_for(report) if report else None)
    if args.metrics is None and path is None and args.dashboard is None:
        return None
    from hotspare.observe.observer import Observer
    sinks, file, server, dashboard = [], None, None, None
    if args.metrics is not None:
        from hotspare.observe.metrics import MetricsServer, RunMetrics, parse_address
        host, port = parse_address(args.metrics)
        metrics = RunMetrics()
        server = MetricsServer(metrics.registry, host, port)
        sinks.append(metrics.consume)
        log(f"metrics: http://{server.address}/metrics (Prometheus; docs/OBSERVABILITY.md)")
    try:
        if path is not None:
            from hotspare.observe.stream import EventFile
            file = EventFile(path)
            sinks.append(file)
            log(f"events: {path} (hotspare events --follow {path})")
        if args.dashboard is not None:
            dashboard = open_dashboard(args.dashboard, secret, log, "read-only")
            sinks.append(dashboard)
    except Exception:
        for part in (server, file):
            if part is not None:
                part.close()
        raise
    observer = Observer(ledger, coordinator.view, sinks, health=health, nodes=coordinator.nodes).install(coordinator)
    observer.start(ledger.settings)
    return Watch(observer, file, server, path, dashboard)


def open_dashboard(address: str, secret: bytes, log: Callable[[str], None], what: str):
    """The dashboard on ``address``; its login token (derived from the secret) in a file only
    this user can read, whose path is logged (never the token) with ``what`` it allows."""
    import os
    import tempfile

    from hotspare.observe.dashboard import Dashboard, dashboard_token
    from hotspare.observe.metrics import parse_address
    host, port = parse_address(address, "--dashboard")
    token = dashboard_token(secret)
    folder = tempfile.mkdtemp(prefix="hotspare-dashboard-")          # 0700
    token_file = os.path.join(folder, "token")
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    try:
        dash = Dashboard(host, port, token, log)
    except Exception:
        import shutil
        shutil.rmtree(folder, ignore_errors=True)
        raise
    dash.token_folder = folder
    log(f"dashboard: http://{dash.address}/ ({what}; log in with the token in {token_file})")
    return dash
