"""The coordinator's health desk without processes: readings in, verdicts out, lifecycle kept."""
import time

from hotspare.coordinator.events import DeviceChecked
from hotspare.coordinator.health import STRAGGLER_WINDOW, HealthMonitor
from hotspare.health import types as T
from hotspare.health.lifecycle import State
from hotspare.health.registry import Registry
from hotspare.health.rulefile import load_rules
from hotspare.health.types import Reading

DEVICES = [f"n1/cpu{i}" for i in range(5)]


def monitor(tmp_path, **kw):
    m = HealthMonitor(load_rules(), Registry(tmp_path / "h.json"), DEVICES, log=lambda line: None, **kw)
    for rank in range(4):
        m.assign(rank, DEVICES[rank], f"w{rank}")
    return m


def test_straggler_score_uses_window_minimums_so_noise_does_not_fire(tmp_path):
    m = monitor(tmp_path)
    readings = []
    for step in range(STRAGGLER_WINDOW):
        for rank in range(4):
            noisy = 0.010 * (1 + 4 * ((step + rank) % 3 == 0))      # 5x spikes on every rank
            readings += m.step_timing(rank, noisy, 0.001, float(step))
    scores = {r.rank: r.metrics[T.STRAGGLER_SCORE] for r in readings}
    assert set(scores) == {1, 2, 3} and all(0.9 <= s <= 1.1 for s in scores.values())


def test_a_really_slower_rank_scores_below_the_threshold(tmp_path):
    m = monitor(tmp_path)
    out = []
    for step in range(3 * STRAGGLER_WINDOW):
        for rank in range(4):
            out += m.step_timing(rank, 0.020 if rank == 2 else 0.010, 0.001, float(step))
    slow = [r.metrics[T.STRAGGLER_SCORE] for r in out if r.rank == 2]
    assert slow and all(s == 0.5 for s in slow)
    assert all(r.metrics[T.STRAGGLER_SCORE] >= 1.0 for r in out if r.rank != 2)


def test_a_vote_failure_fires_once_and_never_condemns_the_replacement(tmp_path):
    m = monitor(tmp_path)
    now = time.time()
    (reading,) = m.vote_readings({"kind": "fingerprint", "suspects": [3], "step": 7}, now)
    v = m.observe(reading, now)
    assert (v.action, v.rule, v.rank, v.trust_memory) == ("failover", "fingerprint-mismatch", 3, False)
    m.assign(3, DEVICES[4], "w4")                        # the spare took rank 3 on another device
    nominal = Reading(DEVICES[3], now + 1, "simulated", {T.TEMP_C: 50.0})
    assert m.observe(nominal, now + 1) is None, "an old vote must not fire again"


def test_verdicts_name_the_rank_on_the_device_now(tmp_path):
    m = monitor(tmp_path)
    now = time.time()
    for i in range(2):
        v = m.observe(Reading(DEVICES[1], now + i, "simulated", {T.TEMP_C: 93.0}, rank=None), now + i)
    assert v.rank == 1 and v.action == "migrate"


class ScriptedNode:
    """The node's side of the desk, scripted: it records the commands the desk sends; the test
    answers them as the node agent would (``checked``, see hotspare.agent.checks)."""

    def __init__(self, name="n1"):
        self.name, self.commands = name, []

    def tell(self, node, msg):
        assert node == self.name
        self.commands.append(msg)
        return True

    def answer(self, m, device, passed=True, cancelled=False, detail="burn-in ok; memory ok", stage="quarantine"):
        m.checked(DeviceChecked(self.name, device, stage, passed, cancelled, detail, time.time()))


def connected(m, node=None):
    node = node or ScriptedNode()
    m.attach(node.tell)
    m.node_connected(node.name, DEVICES)
    return node


def test_cordoned_device_drains_quarantines_and_returns_after_diagnostics_on_its_node(tmp_path):
    resets = []
    m = monitor(tmp_path, reset=resets.append)
    node = connected(m)
    m.cordon(DEVICES[1], "too hot", "temp-limit", time.time())
    assert not m.usable(DEVICES[1]) and m.registry.get(DEVICES[1]).state == State.CORDONED
    m.device_released(DEVICES[1])                       # its worker left
    assert [c["type"] for c in node.commands] == ["diagnose"] and node.commands[0]["device"] == DEVICES[1]
    node.answer(m, DEVICES[1])                          # pass 1: the desk asks for pass 2
    assert len(node.commands) == 2 and m.registry.get(DEVICES[1]).state == State.QUARANTINED
    node.answer(m, DEVICES[1])
    rec = m.registry.get(DEVICES[1])
    assert [t.dst.value for t in rec.history] == ["cordoned", "draining", "quarantined", "healthy"]
    assert resets == [DEVICES[1]] and m.usable(DEVICES[1]) and not m.pending()
    assert rec.remediations, "a rule's cordon counts for the repeat-offender rule"


def test_a_failed_pass_or_hot_telemetry_keeps_the_device_out(tmp_path):
    hot = []
    m = monitor(tmp_path, poll=lambda: list(hot))
    node = connected(m)
    for d in DEVICES[1:3]:
        m.cordon(d, "too hot", "temp-limit", time.time())
    m.device_released(DEVICES[1])
    node.answer(m, DEVICES[1], passed=False, detail="memory: 3 words read back wrong")
    assert m.registry.get(DEVICES[1]).state != State.HEALTHY and DEVICES[1] not in m.diagnosing
    assert "memory: 3 words" in m.registry.get(DEVICES[1]).reason
    hot.append(Reading(DEVICES[2], time.time(), "simulated", {T.XIDS: (79,)}))
    m.device_released(DEVICES[2])                       # still hot after the reset: no checks are run
    assert [c["device"] for c in node.commands] == [DEVICES[1]]
    assert "telemetry still trips" in m.registry.get(DEVICES[2]).reason


def test_cut_short_diagnostics_leave_the_device_quarantined_for_the_next_job(tmp_path):
    lines = []
    m = HealthMonitor(load_rules(), Registry(tmp_path / "h.json"), DEVICES, log=lines.append)
    node = connected(m)
    m.cordon(DEVICES[1], "too hot", "temp-limit", time.time())
    m.device_released(DEVICES[1])
    m.stop()                                            # the job is stopping
    node.answer(m, DEVICES[1], passed=False, cancelled=True, detail="cut short")
    assert m.registry.get(DEVICES[1]).state == State.QUARANTINED
    assert any("diagnostics cut short" in line for line in lines), lines
    m.cordon(DEVICES[2], "too hot", "temp-limit", time.time())
    m.device_released(DEVICES[2])                       # after stop: none started
    assert m.registry.get(DEVICES[2]).state == State.QUARANTINED and DEVICES[2] not in m.diagnosing
    assert any("diagnostics not started" in line for line in lines), lines

    # The next job's desk takes both up again as their node connects, and they pass.
    again = HealthMonitor(load_rules(), Registry(tmp_path / "h.json"), DEVICES, log=lines.append)
    node = connected(again)
    assert sorted(c["device"] for c in node.commands) == DEVICES[1:3]
    for _ in range(2):
        for d in DEVICES[1:3]:
            node.answer(again, d)
    assert all(again.registry.get(d).state == State.HEALTHY for d in DEVICES[1:3])


def test_a_verdict_from_another_node_or_unasked_changes_nothing(tmp_path):
    m = monitor(tmp_path)
    connected(m)
    m.cordon(DEVICES[1], "too hot", "temp-limit", time.time())
    m.device_released(DEVICES[1])
    ScriptedNode("n2").answer(m, DEVICES[1])            # not the device's node
    ScriptedNode().answer(m, DEVICES[3])                # no diagnostics were asked for
    assert m.registry.get(DEVICES[1]).state == State.QUARANTINED and m.diagnosing == {DEVICES[1]: 0}
    assert m.registry.get(DEVICES[3]).state == State.HEALTHY


def test_admission_on_the_node_holds_devices_until_they_pass(tmp_path):
    m = monitor(tmp_path, admission="small")
    node = connected(m)
    (cmd,) = node.commands
    assert (cmd["type"], cmd["devices"], cmd["size"]) == ("admit", DEVICES, "small")
    assert not any(m.usable(d) for d in DEVICES) and m.pending()
    for d in DEVICES[:-1]:
        node.answer(m, d, stage="admission")
    node.answer(m, DEVICES[-1], passed=False, stage="admission", detail="burn-in: 12 elements differ")
    assert not m.pending() and all(m.usable(d) for d in DEVICES[:-1]) and not m.usable(DEVICES[-1])
    rec = m.registry.get(DEVICES[-1])
    assert rec.state == State.QUARANTINED and "failed admission: burn-in: 12 elements" in rec.reason


def test_a_repeat_offender_is_retired_instead_of_diagnosed(tmp_path):
    m = monitor(tmp_path)
    node = connected(m)
    m.cordon(DEVICES[2], "fifth time", "repeat-offender", time.time(), retire=True)
    m.device_released(DEVICES[2])
    assert m.registry.get(DEVICES[2]).state == State.RETIRED and node.commands == []


def test_operator_drain_of_a_busy_device_asks_for_a_migration(tmp_path):
    m = monitor(tmp_path)
    assert m.operator_requests() == []
    Registry(tmp_path / "h.json").drain(DEVICES[0], "fan replacement")   # another process: the CLI
    (v,) = m.operator_requests()
    assert (v.device, v.rank, v.action, v.rule) == (DEVICES[0], 0, "migrate", "operator-drain")


def test_a_drain_is_asked_for_until_its_migration_is_ordered_then_never_again(tmp_path):
    """A drain that comes while the job cannot move a rank (forming, recovering, another
    migration on its way) is not lost: it is asked for at every poll until the policy orders the
    migration; then never again while that rank is there (the fault: a drain read twice
    migrated a rank that had already moved). Said in the log and the report once."""
    from hotspare.policy.actions import Pause
    said = []
    m = HealthMonitor(load_rules(), Registry(tmp_path / "h.json"), DEVICES, log=said.append)
    for rank in range(4):
        m.assign(rank, DEVICES[rank], f"w{rank}")
    Registry(tmp_path / "h.json").drain(DEVICES[0], "fan replacement")
    asked, t = [], 100.0

    def deferred(v, first):
        asked.append((v.device, v.rank, first))
        return None

    m.poll_operator(t, deferred)
    m.poll_operator(t + 0.5, deferred)              # polled at most once a second
    m.poll_operator(t + 1.5, deferred)
    assert asked == [(DEVICES[0], 0, True), (DEVICES[0], 0, False)]

    class Ordered:
        actions = (Pause(1, 0, "w9", DEVICES[0], "drained", "operator-drain"),)

    m.poll_operator(t + 3, lambda v, first: asked.append(v.rank) or Ordered())
    m.poll_operator(t + 5, lambda v, first: asked.append("again"))
    assert asked[-1] == 0, "asked again after the migration was ordered"
    assert said.count(f"OPERATOR {DEVICES[0]}: drained by the operator: fan replacement") == 1, said
    m.assign(0, DEVICES[3], "w9")                    # the rank now runs elsewhere: the drain is done
    assert m.operator_requests() == [] and m._drains == {}
