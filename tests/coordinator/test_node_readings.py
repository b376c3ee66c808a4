"""A remote node's telemetry on the launcher's side: the ``readings`` message (bounded, finite),
its decoding into ``Readings`` at the node endpoint (a node reports only its own devices), and
the health desk that adopts a remote node's devices and diagnoses them on its agent."""
import queue
import time

import pytest

from hotspare.coordinator import events as ev
from hotspare.coordinator.events import DeviceChecked
from hotspare.coordinator.health import HealthMonitor
from hotspare.coordinator.nodes import NodeEndpoint
from hotspare.errors import ProtocolError
from hotspare.health import types as T
from hotspare.health.lifecycle import State
from hotspare.health.registry import Registry
from hotspare.health.rulefile import load_rules
from hotspare.health.types import Reading
from hotspare.protocol import auth
from hotspare.protocol.messages import MAX_ITEMS, decode, encode, make

SECRET = b"r" * 32


def item(device="n1/cpu0", **metrics):
    return {"device": device, "time": time.time(), "source": "simulated",
            "metrics": metrics or {"temp_c": 55.0, "xids": [], "pcie_gen": 5, "remap_pending": False}}


def test_a_readings_message_round_trips_and_bad_ones_are_refused():
    msg = make("readings", readings=[item(), item("n1/cpu1", xids=[79], recovery_action="none")])
    assert decode(encode(msg)) == msg
    for metric in (b'"temp_c":NaN', b'"temp_c":1e999', b'"temp_c":Infinity'):
        line = encode(msg).replace(b'"temp_c":55.0', metric)
        with pytest.raises(ProtocolError):
            decode(line)
    for wrong in ([], [item()] * (MAX_ITEMS + 1), [{**item(), "source": "runtime"}], [item(temp_c={"x": 1})],
                  [item(xids=list(range(65)))], [item(xids=[1.5])], [{**item(), "time": -1}], ["n1/cpu0"],
                  [item(**{f"m{i}": 1 for i in range(65)})], [{**item(), "device": "x" * 300}]):
        with pytest.raises(ProtocolError):
            make("readings", readings=wrong)


def test_decoding_keeps_only_telemetry_metrics_and_sane_time_stamps():
    now = time.time()
    e = ev.decode("n1", make("readings", readings=[item(xids=[79, 48], temp_c=91.5)]), lambda t: min(t, now), now)
    assert isinstance(e, ev.Readings) and e.node == "n1"
    (r,) = e.readings
    assert (r.device, r.source, r.rank, r.metrics) == ("n1/cpu0", "simulated", None, {"xids": (79, 48), "temp_c": 91.5})
    for spoof in ("nonfinite", "fingerprint_mismatch", "straggler_score"):    # the runtime's, not a node's
        with pytest.raises(ProtocolError, match="not a telemetry metric"):
            ev.decode("n1", make("readings", readings=[item(**{spoof: True})]), lambda t: t, now)


@pytest.fixture
def node_link():
    events: queue.Queue = queue.Queue()
    endpoint = NodeEndpoint(events, SECRET, owner=lambda w: None)
    ch = auth.connect(endpoint.address, auth.NODE, auth.node_key(SECRET), node="n1", pid=1,
                      devices=["n1/cpu0", "n1/cpu1"], device_faults=False)
    assert isinstance(events.get(timeout=10), ev.NodeConnected)
    try:
        yield events, ch
    finally:
        ch.close()
        endpoint.close()


def test_the_endpoint_refuses_readings_of_another_nodes_device_and_goes_on(node_link, capfd):
    events, ch = node_link
    ch.send(make("readings", readings=[item("n1/cpu0"), item("n2/cpu0")]))    # one alien: all refused
    ch.send(make("readings", readings=[item("n1/cpu2")]))                     # its name, not its slot
    ch.send(make("readings", readings=[item("n1/cpu1")]))
    e = events.get(timeout=10)
    assert isinstance(e, ev.Readings) and [r.device for r in e.readings] == ["n1/cpu1"] and e.node == "n1"
    err = capfd.readouterr().err
    assert "refusing 'readings' from node n1" in err and "n2/cpu0: not this node's devices" in err
    assert "n1/cpu2: not this node's devices" in err
    assert events.empty()


class Node:
    def __init__(self, name):
        self.name, self.commands = name, []

    def tell(self, node, msg):
        assert node == self.name
        self.commands.append(msg)
        return True


def desk(tmp_path, lines, local=("hub/cpu0",)):
    m = HealthMonitor(load_rules(), Registry(tmp_path / "h.json"), list(local), log=lines.append, adopt=True)
    node = Node("hostb")
    m.attach(node.tell)
    m.node_connected("hostb", ["hostb/cpu0", "hostb/cpu1", "hosta/cpu0"])
    return m, node


def test_a_remote_nodes_devices_join_the_desk_and_its_readings_judge_them(tmp_path):
    lines = []
    m, node = desk(tmp_path, lines)
    assert m.devices == ["hub/cpu0", "hostb/cpu0", "hostb/cpu1"] and m.remote == {"hostb/cpu0", "hostb/cpu1"}
    assert any("hosta/cpu0" in line and "not one of its own" in line for line in lines), lines
    assert m.registry.get("hostb/cpu1").state == State.HEALTHY          # the launcher's registry is the record
    m.assign(2, "hostb/cpu1", "w2")
    now = time.time()
    hot = [Reading("hostb/cpu1", now + i, "simulated", {T.TEMP_C: 92.0}) for i in range(2)]
    assert m.node_readings("hosta", hot, now) == [], "another node's readings of it are not taken"
    assert m.node_readings("hostb", [Reading("hub/cpu0", now, "simulated", {T.TEMP_C: 99.0})], now) == []
    verdicts = [m.observe(r, now + 1) for r in m.node_readings("hostb", hot, now)]
    assert verdicts[0] is None and (verdicts[1].action, verdicts[1].rule, verdicts[1].rank) == ("migrate", "temp-limit", 2)


def test_remote_diagnostics_reset_on_the_node_and_count_only_with_fresh_clean_telemetry(tmp_path):
    lines = []
    m, node = desk(tmp_path, lines)
    dev = "hostb/cpu0"
    for d in (dev, "hostb/cpu1"):
        m.cordon(d, "too hot", "temp-limit", time.time())
        m.device_released(d)
    first = [c for c in node.commands if c["device"] == dev]
    assert [(c["type"], c["reset"]) for c in first] == [("diagnose", True)], "the node resets it, not the launcher"

    def answer(d):
        m.checked(DeviceChecked("hostb", d, "quarantine", True, False, "burn-in ok", time.time()))

    # the agent's poll before the checks: clean
    m.node_readings("hostb", [Reading(dev, time.time(), "simulated", {T.TEMP_C: 55.0})], time.time())
    answer(dev)
    second = [c for c in node.commands if c["device"] == dev]
    assert len(second) == 2 and second[1]["reset"] is False and m.diagnosing[dev] == 1
    answer(dev)                            # no reading came with the second pass: it does not count
    assert m.registry.get(dev).state == State.QUARANTINED and dev not in m.diagnosing
    assert "no telemetry reading from node hostb came with the pass" in m.registry.get(dev).reason
    # the other device: its fresh poll still trips a rule (an Xid 79) -> failed
    m.node_readings("hostb", [Reading("hostb/cpu1", time.time(), "simulated", {T.XIDS: (79,)})], time.time())
    answer("hostb/cpu1")
    assert "telemetry still trips" in m.registry.get("hostb/cpu1").reason
    assert any("pass 1/2 on node hostb" in line for line in lines), lines


def test_without_adopt_a_nodes_unknown_devices_stay_unwatched(tmp_path):
    m = HealthMonitor(load_rules(), Registry(tmp_path / "h.json"), ["hub/cpu0"], log=lambda line: None)
    m.node_connected("hostb", ["hostb/cpu0"])
    assert m.devices == ["hub/cpu0"] and not m.remote
    assert m.node_readings("hostb", [Reading("hostb/cpu0", time.time(), "simulated", {T.TEMP_C: 99.0})], 0) == []


def test_the_polls_of_many_nodes_reach_the_registry_in_one_write_per_second(tmp_path):
    m, _ = desk(tmp_path, [])
    writes = []
    real = m.registry.record_readings
    m.registry.record_readings = lambda rs: (writes.append([(r.device, r.metrics[T.TEMP_C]) for r in rs]), real(rs))
    t0 = 1000.0
    m.record_readings([Reading("hostb/cpu0", t0, "simulated", {T.TEMP_C: 50.0})], t0)
    for i in range(1, 5):               # four more polls within the second: kept, not written
        m.record_readings([Reading(d, t0 + i / 10, "simulated", {T.TEMP_C: 50.0 + i}) for d in ("hostb/cpu0", "hub/cpu0")],
                          t0 + i / 10)
    assert writes == [[("hostb/cpu0", 50.0)]]
    m.stop()                            # the job stops: the newest of each is written
    assert writes[1:] == [[("hostb/cpu0", 54.0), ("hub/cpu0", 54.0)]]
    assert m.registry.get("hostb/cpu0").readings["simulated"].metrics[T.TEMP_C] == 54.0
