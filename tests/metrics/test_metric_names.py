"""The metrics follow Prometheus's conventions and say what the event records say: a killed rank
recovered from memory is counted under kind="killed", path="memory", its downtime lands in the
histogram, the zero-loss share appears with the first failure; telemetry and device states are
per device; no label is a rank or a step."""
import math

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hotspare.coordinator import events as ev
from hotspare.health.types import Reading
from hotspare.observe.metrics import RunMetrics

T = 1796300000.0
FAILURE = {"cause": "killed", "kind": "SIGKILL", "rank": 2, "step": 15, "recovery_path": None, "lost_steps": None,
           "downtime_s": None, "detection_latency_s": 0.05, "phases_s": {}}
RECOVERED = {**FAILURE, "recovery_path": "memory", "lost_steps": 0, "downtime_s": 0.42,
             "phases_s": {"detect": 0.05, "decide": 0.01, "rebuild_groups": 0.2, "transfer_state": 0.06,
                          "first_committed_step": 0.1}}


def _samples(m: RunMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(m.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _feed(m: RunMetrics, *recs) -> None:
    for kind, data in recs:
        m.consume(ev.record(kind, T, data))


def test_names_units_and_labels_follow_the_conventions():
    m = RunMetrics()
    _feed(m, ("run_start", {}), ("failure", FAILURE), ("failover", RECOVERED), ("recovered", RECOVERED),
          ("devices", {"devices": [{"device": "n0/gpu0", "state": "healthy", "reason": ""}]}))
    m.consume(ev.to_record(ev.Readings([Reading("n0/gpu0", T, "nvml", {"temp_c": 70.0, "ecc_dbe_volatile": 2,
                                                                         "xids": (79,)})], T)))
    families = list(text_string_to_metric_families(generate_latest(m.registry).decode()))
    for fam in families:
        assert fam.name.startswith("hotspare_"), fam.name
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), fam.name
        if fam.type == "histogram":
            assert fam.name.endswith("_seconds"), fam.name
        for s in fam.samples:
            assert not {"rank", "step", "job", "worker"} & set(s.labels), (fam.name, s.labels)
    names = {f.name for f in families}
    assert {"hotspare_failures", "hotspare_recovery_downtime_seconds", "hotspare_lost_steps",
            "hotspare_repeated_steps", "hotspare_zero_loss_share_ratio", "hotspare_step_duration_seconds",
            "hotspare_committed_step", "hotspare_generation", "hotspare_spares", "hotspare_migrations",
            "hotspare_checkpoint_fallbacks", "hotspare_device_state", "hotspare_device_temperature_celsius",
            "hotspare_device_ecc_errors", "hotspare_device_xid_errors"} <= names, names


def test_a_killed_rank_recovered_from_memory_is_counted_with_its_downtime():
    m = RunMetrics()
    assert ("hotspare_zero_loss_share_ratio", ()) not in _samples(m)     # no failure yet: no share
    _feed(m, ("failure", FAILURE))
    assert _samples(m)[("hotspare_zero_loss_share_ratio", ())] == 0.0
    _feed(m, ("failover", RECOVERED), ("generation", {"gen": 2, "world_size": 4, "lost_steps": 0}),
          ("recovered", RECOVERED))
    s = _samples(m)
    assert s[("hotspare_failures_total", (("kind", "killed"), ("path", "memory")))] == 1
    assert s[("hotspare_recovery_downtime_seconds_count", (("path", "memory"),))] == 1
    assert math.isclose(s[("hotspare_recovery_downtime_seconds_sum", (("path", "memory"),))], 0.42)
    assert s[("hotspare_recovery_downtime_seconds_bucket", (("le", "0.25"), ("path", "memory")))] == 0
    assert s[("hotspare_recovery_downtime_seconds_bucket", (("le", "0.5"), ("path", "memory")))] == 1
    assert math.isclose(s[("hotspare_recovery_phase_seconds_sum", (("phase", "rebuild_groups"),))], 0.2)
    assert s[("hotspare_zero_loss_share_ratio", ())] == 1.0 and s[("hotspare_generation", ())] == 2
    assert s[("hotspare_lost_steps_total", ())] == 0


def test_a_job_stopped_with_a_failure_open_counts_it_as_stopped_and_checkpoint_losses_count():
    m = RunMetrics()
    hang = {**FAILURE, "cause": "node lost"}
    _feed(m, ("failure", hang), ("unrecovered", {**hang, "recovery_path": "stopped"}),
          ("failure", FAILURE), ("failover", {**RECOVERED, "recovery_path": "checkpoint", "lost_steps": 7}),
          ("generation", {"gen": 3, "world_size": 4, "lost_steps": 7}),
          ("steps_repeated", {"total": 2}), ("steps_repeated", {"total": 3}), ("checkpoint_fallback", {}))
    s = _samples(m)
    assert s[("hotspare_failures_total", (("kind", "node_lost"), ("path", "stopped")))] == 1
    assert s[("hotspare_failures_total", (("kind", "killed"), ("path", "checkpoint")))] == 1
    assert s[("hotspare_lost_steps_total", ())] == 7 and s[("hotspare_repeated_steps_total", ())] == 3
    assert s[("hotspare_zero_loss_share_ratio", ())] == 0.0
    assert s[("hotspare_checkpoint_fallbacks_total", ())] == 1


def test_rank_0_commits_feed_step_time_and_telemetry_is_per_device():
    m = RunMetrics()
    for step in range(3):
        m.consume(ev.to_record(ev.WorkerSaid("w0", {"type": "commit", "rank": 0, "step": step, "dt": 0.03}, T)))
    m.consume(ev.to_record(ev.Readings([
        Reading("n0/gpu0", T, "nvml", {"temp_c": 70.0, "ecc_sbe_volatile": 5, "xids": (79,)}),
        Reading("n0/gpu1", T, "nvml", {"temp_c": 64.5, "remap_pending": True, "xids": ()})], T)))
    m.consume(ev.to_record(ev.Readings([Reading("n0/gpu0", T + 1, "nvml", {"temp_c": 72.0, "xids": (48,)})], T)))
    _feed(m, ("devices", {"devices": [{"device": "n0/gpu0", "state": "quarantined", "reason": "xid 79"}]}))
    s = _samples(m)
    assert s[("hotspare_committed_step", ())] == 2 and s[("hotspare_step_duration_seconds_count", ())] == 3
    assert s[("hotspare_device_temperature_celsius", (("device", "n0/gpu0"),))] == 72.0
    assert s[("hotspare_device_temperature_celsius", (("device", "n0/gpu1"),))] == 64.5
    assert s[("hotspare_device_row_remap_pending", (("device", "n0/gpu1"),))] == 1.0
    assert s[("hotspare_device_ecc_errors_total", (("device", "n0/gpu0"), ("type", "corrected")))] == 5
    assert s[("hotspare_device_xid_errors_total", (("device", "n0/gpu0"),))] == 2
    assert s[("hotspare_device_state", (("device", "n0/gpu0"), ("state", "quarantined")))] == 1.0
    assert s[("hotspare_device_state", (("device", "n0/gpu0"), ("state", "healthy")))] == 0.0


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the reference Grafana dashboard, its variables filled in."""
    import json
    from pathlib import Path
    dash = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana" / "hotspare.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", ())]
    exprs += [a["expr"] for a in dash["annotations"]["list"]]
    fill = {"$instance": ".*", "$job_name": ".*", "$__rate_interval": "1m", "$__range": "1h"}
    for var, value in fill.items():
        exprs = [e.replace(var, value) for e in exprs]
    return exprs


def test_the_grafana_dashboard_names_only_metrics_hotspare_exposes():
    import re
    m = RunMetrics()
    _feed(m, ("failure", FAILURE), ("failover", RECOVERED), ("recovered", RECOVERED),
          ("health_event", {"rule": "xid-79", "action": "failover"}),
          ("devices", {"devices": [{"device": "n0/gpu0", "state": "healthy", "reason": ""}]}))
    m.consume(ev.to_record(ev.Readings([Reading("n0/gpu0", T, "nvml", {
        "temp_c": 70.0, "mem_temp_c": 75.0, "ecc_sbe_volatile": 1, "pcie_replay": 0, "nvlink_crc_errors": 0,
        "clock_event_reasons": 0, "power_w": 300.0, "xids": ()})], T)))
    exposed = {name for name, _ in _samples(m)}
    queries = dashboard_queries()
    assert len(queries) > 20
    named = {n for q in queries for n in re.findall(r"\bhotspare_[a-z_]+", q)}
    assert named and named <= exposed, sorted(named - exposed)
