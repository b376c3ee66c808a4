"""A remote agent's own telemetry (hotspare.agent.telemetry): its source for its slots, the
poller that sends readings up, the reset and fresh poll before a diagnostics pass, and device
faults on its simulated devices; then the whole path over a real link to the node endpoint."""
import math
import os
import queue
import sys
import time

import pytest

from hotspare.agent import NodeAgent
from hotspare.agent.telemetry import NodeTelemetry, node_source, wire
from hotspare.coordinator import events as ev
from hotspare.coordinator.nodes import NodeEndpoint
from hotspare.errors import ConfigError
from hotspare.health import types as T
from hotspare.health.telemetry import SimulatedSource
from hotspare.health.types import Reading
from hotspare.protocol.messages import make
from hotspare.testing.faults import parse

SECRET = b"t" * 32
SLOTS = ["hostb/cpu0", "hostb/cpu1"]


def test_cpu_slots_get_a_simulated_source_named_as_the_slots():
    source, detail = node_source("hostb", SLOTS)
    assert isinstance(source, SimulatedSource) and source.devices() == SLOTS
    assert "SIMULATED" in detail
    assert node_source("hostb", []) == (None, "telemetry: none (no device slots)")
    with pytest.raises(ConfigError):
        node_source("hostb", ["hostb/cpu1"])        # slots that are not cpu0..: not what the source names


def test_a_reading_goes_on_the_wire_plain_finite_and_bounded():
    r = Reading("hostb/cpu0", 1.0, "nvml", {T.TEMP_C: math.nan, T.XIDS: (79,), T.DEVICE_ERROR: "x" * 999,
                                            T.POWER_W: 300.5, T.REMAP_PENDING: False})
    assert wire(r) == {"device": "hostb/cpu0", "time": 1.0, "source": "nvml",
                       "metrics": {T.XIDS: [79], T.DEVICE_ERROR: "x" * 256, T.POWER_W: 300.5, T.REMAP_PENDING: False}}
    assert wire(Reading("hostb/cpu0", 1.0, "nvml", {T.TEMP_C: math.inf})) is None


class Checks:
    prepare = None


class FakeAgent:
    """What NodeTelemetry uses of the agent: ``report`` (validated as the uplink would) and ``checks``."""

    def __init__(self):
        self.sent, self.checks = queue.Queue(), Checks()

    def report(self, type_, **fields):
        self.sent.put(make(type_, **fields))


def test_the_poller_sends_the_slots_readings_and_a_pass_starts_with_a_reset_and_a_fresh_poll():
    lines = []
    tel = NodeTelemetry("hostb", SLOTS, lines.append, allow_inject=True)
    agent = FakeAgent()
    try:
        tel.start(agent, 0.05)
        msg = agent.sent.get(timeout=10)
        assert msg["type"] == "readings" and [r["device"] for r in msg["readings"]] == SLOTS
        assert all(r["source"] == "simulated" for r in msg["readings"])
        assert any("SIMULATED" in line and "every 0.05 s" in line for line in lines), lines
        # the fault plug-in drives this host's simulated device
        faults = tel.job_faults()
        assert faults is not None and faults.device_faults and tel.device_faults and tel.injectable
        assert tel.job_faults() is not faults            # each job's agent arms its own faults
        faults.device_fault("hostb/cpu1", parse("thermal:rank=1:step=3:temp=92"))
        deadline = time.time() + 10
        while True:
            temps = {r["device"]: r["metrics"]["temp_c"] for r in agent.sent.get(timeout=10)["readings"]}
            if temps["hostb/cpu1"] == 92.0 or time.time() > deadline:
                break
        assert temps == {"hostb/cpu0": 55.0, "hostb/cpu1": 92.0}
        tel.stop()                               # the job's part here ended: no more polls
        assert tel.poller is None
        time.sleep(0.2)
        while not agent.sent.empty():
            agent.sent.get()
        assert agent.sent.empty()
        tel.start(agent, 0.05)                   # the next job on this node polls again
        assert agent.sent.get(timeout=10)["type"] == "readings"
        tel.stop()
        time.sleep(0.2)
        while not agent.sent.empty():
            agent.sent.get()
        assert agent.checks.prepare == tel.prepare
        tel.prepare("hostb/cpu1", True)          # the first pass: reset, then one fresh poll of it
        (r,) = agent.sent.get(timeout=1)["readings"]
        assert (r["device"], r["metrics"]["temp_c"], r["metrics"]["clock_event_reasons"]) == ("hostb/cpu1", 55.0, 0)
        assert any("QUARANTINE hostb/cpu1: diagnostics pass starting on this node, after a reset" in line
                   for line in lines), lines
    finally:
        tel.close()


def test_no_polling_when_the_launcher_asks_for_none_and_no_plugin_unless_allowed():
    lines = []
    tel = NodeTelemetry("hostb", SLOTS, lines.append)
    agent = FakeAgent()
    tel.start(agent, 0)
    assert tel.poller is None and tel.job_faults() is None and not tel.injectable and "not polled" in lines[-1]
    time.sleep(0.2)
    assert agent.sent.empty()
    tel.close()


def test_an_agents_readings_reach_the_coordinator_as_its_nodes_readings():
    events: queue.Queue = queue.Queue()
    endpoint = NodeEndpoint(events, SECRET, owner=lambda w: None)
    agent = NodeAgent([sys.executable, "-c", "pass"], {**os.environ, "OMP_NUM_THREADS": "1"},
                      coordinator=endpoint.address, secret=SECRET, node="hostb", devices=SLOTS, spawn="exec")
    tel = NodeTelemetry("hostb", SLOTS, lambda line: None)
    try:
        assert isinstance(events.get(timeout=10), ev.NodeConnected)
        tel.start(agent, 0.1)
        e = events.get(timeout=10)
        assert isinstance(e, ev.Readings) and e.node == "hostb"
        assert [r.device for r in e.readings] == SLOTS and all(r.metrics[T.TEMP_C] == 55.0 for r in e.readings)
        assert all(r.rank is None and isinstance(r.metrics[T.XIDS], tuple) for r in e.readings)
    finally:
        tel.close()
        agent.shutdown(grace=0.0)
        endpoint.close()


def test_gpu_slots_are_read_by_nvml_and_their_readings_survive_the_wire():
    """NVML's real conversions (over the fake driver of tests/health/test_telemetry.py) -> the
    readings message -> the coordinator's decoding: every metric arrives as it was read."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "nvml_fake_for_agent", Path(__file__).resolve().parents[1] / "health" / "test_telemetry.py")
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    slots = ["g1/gpu0", "g1/gpu1", "g1/gpu2"]
    source, detail = node_source("g1", slots, nvml_lib=fake.FakeNvmlDriver())
    try:
        assert source.name == "nvml" and "580.1" in detail
        polled = source.poll()
        msg = make("readings", readings=[wire(r) for r in polled])
        now = time.time()
        e = ev.decode("g1", msg, lambda t: t, now)
        assert {r.device: dict(r.metrics) for r in e.readings} == {r.device: dict(r.metrics) for r in polled}
        assert {r.device: r.metrics.get(T.DEVICE_ERROR) for r in e.readings}["g1/gpu2"] == "temperature: GPU is lost"
        assert all(r.source == "nvml" for r in e.readings)
    finally:
        source.close()
