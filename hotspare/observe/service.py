"""``/metrics`` of the coordinator service (``hotspare coordinator --metrics ADDR:PORT``): each
job it runs gets the observer and the metrics of ``hotspare run`` (hotspare.observe.observer,
.metrics), and every series is exposed with a ``job_name`` label (the service's job id: one per
submitted job, so bounded by the jobs submitted since the service started). Prometheus's own
``job`` label stays the scrape job's."""
from __future__ import annotations

import threading
from typing import Any

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

    def install(self, job: str, coordinator, ledger, health=None) -> Observer:
        """Observe ``job``'s coordinator (before it starts); its metrics join the service's."""
        metrics = RunMetrics()
        observer = Observer(ledger, coordinator.view, [metrics.consume], health=health, nodes=coordinator.nodes)
        observer.install(coordinator)
        observer.start(ledger.settings)
        with self._lock:
            self._jobs[job] = (metrics, coordinator)
        return observer

    def jobs(self) -> list[tuple[str, RunMetrics, Any]]:
        with self._lock:
            return [(job, m, c) for job, (m, c) in sorted(self._jobs.items())]


class _Jobs(Collector):
    """Every job's families, merged by name, each sample labelled with its job."""

    def __init__(self, service: ServiceMetrics):
        self.service = service

    def collect(self):
        merged: dict[str, Metric] = {}
        for job, metrics, coordinator in self.service.jobs():
            if coordinator.view.phase.over:
                metrics.up.set(0)          # the service's jobs end without a run_end of their own
            for fam in metrics.registry.collect():
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    out.add_sample(s.name, {"job_name": job, **s.labels}, s.value, s.timestamp, s.exemplar)
        yield from merged.values()
