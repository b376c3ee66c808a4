"""Prometheus metrics of a run, fed only by the event stream's records (``consume``): what the
metrics say is what ``hotspare events`` shows. Names follow Prometheus's conventions: base units
(``_seconds``), ``_total`` counters, labels with bounded values only (a failure's cause, its
recovery path, a device, a phase; never a rank or a step). docs/OBSERVABILITY.md lists them.

``serve`` exposes a registry on ``/metrics`` at the address given (``--metrics ADDR:PORT``):
plain HTTP, read-only, no authentication, so bind it to an address of the monitoring network.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hotspare.errors import ConfigError
from hotspare.health import types as ht

# Recoveries take from ~0.1 s (a warm spare on one host) to minutes (a checkpoint restore).
DOWNTIME_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PHASES = ("detect", "decide", "rebuild_groups", "transfer_state", "first_committed_step")
DEVICE_STATES = ("healthy", "suspect", "cordoned", "draining", "quarantined", "retired")

# telemetry reading -> (metric, help, labels); counters are cumulative as the driver reports them
_GAUGES = {
    ht.TEMP_C: ("hotspare_device_temperature_celsius", "GPU core temperature"),
    ht.MEM_TEMP_C: ("hotspare_device_memory_temperature_celsius", "HBM temperature"),
    ht.THERMAL_MARGIN_C: ("hotspare_device_thermal_margin_celsius", "degrees left before thermal slowdown"),
    ht.POWER_W: ("hotspare_device_power_watts", "power draw"),
    ht.CLOCK_EVENT_REASONS: ("hotspare_device_clock_event_reasons",
                             "NVML clock event (throttle) reasons bitmask; 0: none"),
    ht.REMAP_PENDING: ("hotspare_device_row_remap_pending", "1: a row remap is pending (needs a reset)"),
    ht.REMAP_FAILED: ("hotspare_device_row_remap_failed", "1: a row remap failed"),
    ht.PCIE_GEN: ("hotspare_device_pcie_link_generation", "current PCIe link generation"),
    ht.PCIE_WIDTH: ("hotspare_device_pcie_link_width", "current PCIe link width (lanes)"),
}
_COUNTERS = {   # metric -> (family, help, the value of its "type" label or None)
    ht.ECC_SBE_VOLATILE: ("hotspare_device_ecc_errors", "volatile ECC errors", "corrected"),
    ht.ECC_DBE_VOLATILE: ("hotspare_device_ecc_errors", "volatile ECC errors", "uncorrected"),
    ht.PCIE_REPLAY: ("hotspare_device_pcie_replays", "PCIe replay counter", None),
    ht.NVLINK_CRC_ERRORS: ("hotspare_device_nvlink_errors", "NVLink errors", "crc"),
    ht.NVLINK_REPLAY_ERRORS: ("hotspare_device_nvlink_errors", "NVLink errors", "replay"),
    ht.NVLINK_RECOVERY_ERRORS: ("hotspare_device_nvlink_errors", "NVLink errors", "recovery"),
}


def kind_label(cause: str) -> str:
    """A failure's cause as a label value: killed, exited, exception, hang, health, node_lost,
    collective_error (hotspare.policy.signals.FailureCause; the signal or rule is in the event)."""
    return cause.replace(" ", "_")


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


class _Telemetry(Collector):
    """The latest telemetry reading of each device, exposed as they are at scrape time; Xid
    errors counted as they arrive (a reading names those seen since the previous one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: dict[str, dict[str, Any]] = {}
        self._xids: dict[str, int] = {}

    def update(self, readings: Iterable[dict[str, Any]]) -> None:
        with self._lock:
            for r in readings:
                if r.get("source") == "runtime":
                    continue                       # the workers' own signals, not device telemetry
                self._latest.setdefault(r["device"], {}).update(r["metrics"])
                self._xids[r["device"]] = self._xids.get(r["device"], 0) + len(r["metrics"].get(ht.XIDS) or ())

    def collect(self):
        with self._lock:
            latest = {d: dict(m) for d, m in self._latest.items()}
            xids = dict(self._xids)
        for key, (name, doc) in _GAUGES.items():
            fam = GaugeMetricFamily(name, doc, labels=["device"])
            for device, m in sorted(latest.items()):
                v = _number(m.get(key))
                if v is not None:
                    fam.add_metric([device], v)
            yield fam
        families: dict[str, CounterMetricFamily] = {}
        for key, (name, doc, kind) in _COUNTERS.items():
            labels = ["device"] + (["type"] if kind else [])
            fam = families.setdefault(name, CounterMetricFamily(name, doc, labels=labels))
            for device, m in sorted(latest.items()):
                v = _number(m.get(key))
                if v is not None:
                    fam.add_metric([device] + ([kind] if kind else []), v)
        yield from families.values()
        fam = CounterMetricFamily("hotspare_device_xid_errors", "Xid errors seen in readings", labels=["device"])
        for device, n in sorted(xids.items()):
            fam.add_metric([device], n)
        yield fam


class RunMetrics:
    """The metrics of one run, in their own registry, updated from event records."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.failures = Counter("hotspare_failures", "failures by cause and recovery path (memory: a warm "
                                "spare and a peer's state; checkpoint; stopped: the job could not recover)",
                                ["kind", "path"], registry=r)
        self.detected = Counter("hotspare_failures_detected", "failures detected, by cause", ["kind"], registry=r)
        self.recoveries = Counter("hotspare_recoveries", "failures recovered (training committed again)",
                                  ["path"], registry=r)
        self.downtime = Histogram("hotspare_recovery_downtime_seconds", "from the fault (or its detection) to "
                                  "the first step every rank committed after it", ["path"],
                                  buckets=DOWNTIME_BUCKETS, registry=r)
        self.phase = Histogram("hotspare_recovery_phase_seconds", "a recovery's downtime by phase", ["phase"],
                               buckets=DOWNTIME_BUCKETS, registry=r)
        self.detection = Histogram("hotspare_detection_latency_seconds", "from an injected fault to its detection",
                                   ["kind"], buckets=DOWNTIME_BUCKETS, registry=r)
        self.lost = Counter("hotspare_lost_steps", "committed steps lost (recomputed after a checkpoint restore)",
                            registry=r)
        self.repeated = Counter("hotspare_repeated_steps", "steps a rank committed twice", registry=r)
        self.zero_loss = Counter("hotspare_recovered_zero_loss", "failures recovered from memory with no lost "
                                 "step", registry=r)
        self.zero_share = Gauge("hotspare_zero_loss_share_ratio", "share of the detected failures recovered with "
                                "zero lost steps (absent before the first failure)", registry=None)
        self.step = Histogram("hotspare_step_duration_seconds", "wall time of a committed step on rank 0",
                              buckets=STEP_BUCKETS, registry=r)
        self.committed = Gauge("hotspare_committed_step", "the newest step rank 0 committed", registry=r)
        self.generation = Gauge("hotspare_generation", "the current generation (a new one forms at each "
                                "recovery or migration)", registry=r)
        self.world = Gauge("hotspare_world_size", "ranks training in the current generation", registry=r)
        self.spares = Gauge("hotspare_spares", "the spare pool", ["state"], registry=r)
        self.migrations = Counter("hotspare_migrations", "ranks moved off a degrading device", registry=r)
        self.fallbacks = Counter("hotspare_checkpoint_fallbacks", "checkpoints refused on load (an older one "
                                 "was used)", registry=r)
        self.checkpoints = Counter("hotspare_checkpoints", "checkpoints written", registry=r)
        self.health = Counter("hotspare_health_events", "health rule verdicts acted on", ["rule", "action"],
                              registry=r)
        self.device_state = Gauge("hotspare_device_state", "1 for each device's lifecycle state", ["device", "state"],
                                  registry=r)
        self.up = Gauge("hotspare_run_running", "1 while the run trains; 0 once it ended", registry=r)
        self.telemetry = _Telemetry()
        r.register(self.telemetry)
        self._n_detected = self._n_zero = 0
        self._share_registered = False
        for state in ("ready", "starting"):
            self.spares.labels(state)
        self._table = {
            "run_start": lambda d: self.up.set(1), "run_end": lambda d: self.up.set(0),
            "failure": self._failure, "failover": self._failover, "recovered": self._recovered,
            "unrecovered": lambda d: self.failures.labels(kind_label(d["cause"]), "stopped").inc(),
            "generation": self._generation, "worker_said": self._said, "readings": self._readings,
            "migration": lambda d: self.migrations.inc() if d.get("outcome") == "migrated" else None,
            "checkpoint_fallback": lambda d: self.fallbacks.inc(),
            "health_event": lambda d: self.health.labels(d.get("rule", ""), d.get("action", "")).inc(),
            "devices": self._devices, "spares": self._spares,
            "steps_repeated": self._repeated_steps,
        }
        self._n_repeated = 0

    def consume(self, rec: dict[str, Any]) -> None:
        handler = self._table.get(rec["kind"])
        if handler is not None:
            handler(rec["data"])

    # ------------------------------------------------------------------ record kinds
    def _repeated_steps(self, d: dict[str, Any]) -> None:
        if d["total"] > self._n_repeated:
            self.repeated.inc(d["total"] - self._n_repeated)
            self._n_repeated = d["total"]

    def _failure(self, d: dict[str, Any]) -> None:
        self.detected.labels(kind_label(d["cause"])).inc()
        self._n_detected += 1
        self._share()

    def _failover(self, d: dict[str, Any]) -> None:
        self.failures.labels(kind_label(d["cause"]), d["recovery_path"]).inc()
        if d["recovery_path"] == "memory" and d.get("lost_steps") == 0:
            self._n_zero += 1
            self.zero_loss.inc()
        self._share()

    def _share(self) -> None:
        if not self._n_detected:
            return
        if not self._share_registered:
            self.registry.register(self.zero_share)
            self._share_registered = True
        self.zero_share.set(self._n_zero / self._n_detected)

    def _recovered(self, d: dict[str, Any]) -> None:
        path = d.get("recovery_path") or "memory"
        self.recoveries.labels(path).inc()
        if d.get("downtime_s") is not None:
            self.downtime.labels(path).observe(d["downtime_s"])
        for phase, seconds in (d.get("phases_s") or {}).items():
            if phase in PHASES and seconds is not None:
                self.phase.labels(phase).observe(max(0.0, seconds))
        if d.get("detection_latency_s") is not None:
            self.detection.labels(kind_label(d["cause"])).observe(max(0.0, d["detection_latency_s"]))

    def _generation(self, d: dict[str, Any]) -> None:
        self.generation.set(d["gen"])
        self.world.set(d["world_size"])
        if d.get("lost_steps"):
            self.lost.inc(d["lost_steps"])

    def _said(self, d: dict[str, Any]) -> None:
        msg = d["msg"]
        if msg.get("type") == "commit" and msg.get("rank") == 0:
            self.committed.set(msg["step"])
            if _number(msg.get("dt")) is not None:
                self.step.observe(msg["dt"])
        elif msg.get("type") == "checkpointed":
            self.checkpoints.inc()

    def _readings(self, d: dict[str, Any]) -> None:
        self.telemetry.update(d["readings"])

    def _devices(self, d: dict[str, Any]) -> None:
        for dev in d["devices"]:
            for state in DEVICE_STATES:
                self.device_state.labels(dev["device"], state).set(1.0 if dev["state"] == state else 0.0)

    def _spares(self, d: dict[str, Any]) -> None:
        self.spares.labels("ready").set(d["ready"])
        self.spares.labels("starting").set(d["starting"])


def parse_address(text: str, flag: str = "--metrics") -> tuple[str, int]:
    """``--metrics ADDR:PORT`` -> (addr, port); a wildcard address is refused: name the interface."""
    from hotspare.config.run import host_port
    host, port = host_port(text)
    if host in ("0.0.0.0", "::", ""):
        raise ConfigError(f"{flag} {text}: give the address of one interface (e.g. 127.0.0.1:9464 or this host's "
                          "address on the monitoring network), not a wildcard")
    return host, port


class MetricsServer:
    """``/metrics`` of ``registry`` on ``host:port`` (port 0: any free one), in a daemon thread."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        from prometheus_client import start_http_server
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            raise ConfigError(f"--metrics {host}:{port}: cannot listen there ({e.strerror or e}); give a free "
                              "port of an address of this host") from None
        self.host, self.port = host, self._httpd.server_address[1]

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)
