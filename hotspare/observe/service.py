"""Observing the coordinator service (``hotspare coordinator --metrics ADDR:PORT --dashboard
ADDR:PORT``): each job it runs gets the observer of ``hotspare run`` (hotspare.observe.observer).

- ``/metrics``: every job's metrics (hotspare.observe.metrics), every series exposed with a
  ``job_name`` label (the service's job id: one per submitted job, so bounded by the jobs
  submitted since the service started). Prometheus's own ``job`` label stays the scrape job's.
- the dashboard: every job's records, each with ``job`` added (its id), and the cluster's
  (hotspare.observe.cluster), with cordon, drain and uncordon behind the login and a
  confirmation.

``ServiceWatch`` starts what the flags ask for before the service (so a port that cannot be
used stops it at once), gives the service its ``install`` hook, and is attached to the service
once it exists (the dashboard's actions and cluster grid need its hosts and registry)."""
from __future__ import annotations

import threading
from typing import Any, Callable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from hotspare.observe.metrics import RunMetrics
from hotspare.observe.observer import Observer


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._jobs: dict[str, tuple[RunMetrics, Any]] = {}
        self.registry.register(_Jobs(self))

    def add(self, job: str, coordinator) -> RunMetrics:
        """``job``'s metrics, joined to the service's: feed them its records."""
        metrics = RunMetrics()
        with self._lock:
            self._jobs[job] = (metrics, coordinator)
        return metrics

    def install(self, job: str, coordinator, ledger, health=None) -> Observer:
        """Observe ``job``'s coordinator (before it starts); its metrics join the service's."""
        return _observe(coordinator, ledger, health, [self.add(job, coordinator).consume])

    def jobs(self) -> list[tuple[str, RunMetrics, Any]]:
        with self._lock:
            return [(job, m, c) for job, (m, c) in sorted(self._jobs.items())]


def _observe(coordinator, ledger, health, sinks) -> Observer:
    observer = Observer(ledger, coordinator.view, sinks, health=health, nodes=coordinator.nodes)
    observer.install(coordinator)
    observer.start(ledger.settings)
    return observer


class ServiceWatch:
    """The service's /metrics server and dashboard, as asked (``start``), and the hook that
    observes each of its jobs (``install``)."""

    def __init__(self, metrics: ServiceMetrics | None, server, dashboard):
        self.metrics, self.server, self.dashboard = metrics, server, dashboard
        self.feed = None

    @classmethod
    def start(cls, metrics_address: str | None, dashboard_address: str | None, secret: bytes,
              log: Callable[[str], None]) -> "ServiceWatch | None":
        """None when neither is asked for; ConfigError for an address that cannot be used."""
        if metrics_address is None and dashboard_address is None:
            return None
        from hotspare.observe.metrics import MetricsServer, parse_address
        metrics = server = dashboard = None
        if metrics_address is not None:
            host, port = parse_address(metrics_address)
            metrics = ServiceMetrics()
            server = MetricsServer(metrics.registry, host, port)
            log(f"metrics: http://{server.address}/metrics (Prometheus; every job's series labelled job_name)")
        if dashboard_address is not None:
            from hotspare.observe.wiring import open_dashboard
            try:
                dashboard = open_dashboard(dashboard_address, secret, log, "cordon, drain and uncordon need a "
                                                                            "confirmation")
            except Exception:
                if server is not None:
                    server.close()
                raise
        return cls(metrics, server, dashboard)

    def install(self, job: str, coordinator, ledger, health=None) -> Observer:
        sinks = []
        if self.metrics is not None:
            sinks.append(self.metrics.add(job, coordinator).consume)
        if self.dashboard is not None:
            dashboard = self.dashboard
            sinks.append(lambda rec: dashboard({**rec, "job": job}))
        return _observe(coordinator, ledger, health, sinks)

    def attach(self, service) -> None:
        """The dashboard shows ``service``'s hosts and devices and acts through its registry."""
        if self.dashboard is None:
            return
        from hotspare.observe.cluster import ClusterFeed, Operator
        self.feed = ClusterFeed(service.db.hosts, service.registry, self.dashboard, log=self.dashboard.log)
        self.dashboard.operator = Operator(service.db.hosts, service.registry, service.reconciler,
                                           changed=self.feed.poke)

    def close(self) -> None:
        for part in (self.feed, self.dashboard, self.server):
            if part is not None:
                part.close()
        if self.dashboard is not None:
            import shutil
            shutil.rmtree(self.dashboard.token_folder, ignore_errors=True)


class _Jobs(Collector):
    """Every job's families, merged by name, each sample labelled with its job."""

    def __init__(self, service: ServiceMetrics):
        self.service = service

    def collect(self):
        merged: dict[str, Metric] = {}
        for job, metrics, coordinator in self.service.jobs():
            if coordinator.view.phase.over:
                metrics.up.set(0)          # also a job whose run_end never came (its observer broke)
            for fam in metrics.registry.collect():
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    out.add_sample(s.name, {"job_name": job, **s.labels}, s.value, s.timestamp, s.exemplar)
        yield from merged.values()
