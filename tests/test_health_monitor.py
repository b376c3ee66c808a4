"""The coordinator's health desk without processes: readings in, verdicts out, lifecycle kept."""
import threading
import time

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


def test_cordoned_device_drains_quarantines_and_returns_after_diagnostics(tmp_path):
    calls = []
    m = monitor(tmp_path, diagnose=lambda d, stop: (calls.append(d) or True, "ok"), reset=calls.append)
    m.cordon(DEVICES[1], "too hot", "temp-limit", time.time())
    assert not m.usable(DEVICES[1]) and m.registry.get(DEVICES[1]).state == State.CORDONED
    m.device_released(DEVICES[1])                       # its worker left
    m.close()
    rec = m.registry.get(DEVICES[1])
    assert [t.dst.value for t in rec.history] == ["cordoned", "draining", "quarantined", "healthy"]
    assert calls == [DEVICES[1]] * 3 and m.usable(DEVICES[1])   # one reset, two diagnostics passes
    assert rec.remediations, "a rule's cordon counts for the repeat-offender rule"


def test_cancelled_diagnostics_stop_at_once_and_leave_the_device_quarantined(tmp_path):
    from hotspare.health.checks.burnin import burn_in
    lines, started = [], threading.Event()

    def diagnose(device, stop):    # a real burn-in, ten minutes long unless stopped
        started.set()
        result = burn_in(device, n=64, reps=1, seconds=600, stop=stop)
        return result.passed, result.detail
    m = HealthMonitor(load_rules(), Registry(tmp_path / "h.json"), DEVICES, log=lines.append, diagnose=diagnose)
    m.cordon(DEVICES[1], "too hot", "temp-limit", time.time())
    m.device_released(DEVICES[1])
    assert started.wait(10)
    t0 = time.monotonic()
    m.close(timeout=60, cancel=True)
    assert time.monotonic() - t0 < 5, "close(cancel=True) waited for the burn-in"
    assert m.registry.get(DEVICES[1]).state == State.QUARANTINED
    assert any("diagnostics cut short" in line for line in lines), lines
    m.cordon(DEVICES[2], "too hot", "temp-limit", time.time())
    m.device_released(DEVICES[2])                   # after close: none started
    assert m.registry.get(DEVICES[2]).state == State.QUARANTINED and DEVICES[2] not in m.diagnosing
    assert any("diagnostics not started" in line for line in lines), lines

    # The next job's monitor on this node takes both up again, and they pass.
    again = HealthMonitor(load_rules(), Registry(tmp_path / "h.json"), DEVICES, log=lines.append,
                          diagnose=lambda d, stop: (True, "ok"))
    again.close()
    assert all(again.registry.get(d).state == State.HEALTHY for d in DEVICES[1:3])


def test_a_repeat_offender_is_retired_instead_of_diagnosed(tmp_path):
    m = monitor(tmp_path, diagnose=lambda d, stop: (True, "ok"))
    m.cordon(DEVICES[2], "fifth time", "repeat-offender", time.time(), retire=True)
    m.device_released(DEVICES[2])
    m.close()
    assert m.registry.get(DEVICES[2]).state == State.RETIRED


def test_operator_drain_of_a_busy_device_asks_for_a_migration(tmp_path):
    m = monitor(tmp_path)
    assert m.operator_requests() == []
    Registry(tmp_path / "h.json").drain(DEVICES[0], "fan replacement")   # another process: the CLI
    (v,) = m.operator_requests()
    assert (v.device, v.rank, v.action, v.rule) == (DEVICES[0], 0, "migrate", "operator-drain")
    assert m.operator_requests() == [], "each command is acted on once"
