"""The one event schema: every coordinator event survives serialisation (JSON and back) except
its live objects; a record of a newer schema or an unknown kind is refused with what to do; the
observer turns a ledger's "rank 2 killed at step 15, replaced from memory" into one failure, one
failover, one generation and one recovered record, however often it looks."""
import json

import pytest

from hotspare.coordinator import events as ev
from hotspare.coordinator.ledger import Ledger
from hotspare.health.types import Reading
from hotspare.observe.observer import Observer
from hotspare.policy.actions import FormGeneration
from hotspare.policy.view import ClusterView

T = 1796300000.25
SAMPLES = [
    ev.NodeConnected("n0", {"v": 1, "type": "agent_hello", "node": "n0", "pid": 7, "devices": ["n0/cpu0"],
                            "device_faults": False}, None, T),
    ev.NodeLost("n0", None, T),
    ev.NodeResumed("n0", "job-1", ("w0", "w3"), T),
    ev.NodeReleased("n0", "job-1", T),
    ev.AgentRefused("n0", "spawn", "no such device", T),
    ev.DeviceChecked("n0", "n0/gpu1", "quarantine", False, False, "matmul mismatch", T),
    ev.WorkerStarted("w4", 4242, T),
    ev.WorkerStopped("w2", True, T),
    ev.WorkerExited("w2", -9, T),
    ev.WorkerSaid("w0", {"v": 1, "type": "commit", "gen": 2, "rank": 0, "step": 15, "dt": 0.05,
                         "metrics": {"loss": 4.25}}, T),
    ev.FaultInjected("w2", "kill:rank=2:step=15", 0, T),
    ev.Readings([Reading("n0/gpu0", T - 0.5, "nvml", {"temp_c": 71.0, "xids": (79, 48), "remap_pending": False}),
                 Reading("n0/gpu1", T - 0.5, "runtime", {"step_compute_s": 0.2}, rank=1)], T, "n0"),
    ev.OperatorCommand({"v": 1, "type": "inject", "spec": "kill:rank=1:step=3"}, "operator@127.0.0.1", None, T),
    ev.Preempt("SIGTERM", 143, T),
    ev.DeviceLoaned("j1", "j2", ("hostc",), 2, 1000, 0, "j1 (production) is short of 1 device slot(s)", T),
]


def test_every_event_kind_round_trips_through_json():
    assert {type(e) for e in SAMPLES} == set(ev.EVENT_KINDS.values()), "a new event type needs a sample here"
    for event in SAMPLES:
        rec = json.loads(json.dumps(ev.to_record(event), allow_nan=False))
        assert rec["schema"] == ev.SCHEMA and rec["kind"] == ev.KIND_OF[type(event)] and rec["t"] == T
        assert ev.from_record(rec) == event, rec


def test_live_objects_and_proofs_never_reach_a_record():
    hello = {"v": 1, "type": "agent_hello", "node": "n0", "pid": 7, "devices": [], "device_faults": False,
             "proof": "c0ffee"}
    rec = ev.to_record(ev.NodeConnected("n0", hello, object(), T))
    assert "channel" not in rec["data"] and "proof" not in rec["data"]["hello"]
    reply = ev.to_record(ev.OperatorCommand({"type": "cordon"}, "op", lambda m: None, T))
    assert "reply" not in reply["data"]
    assert ev.from_record(rec).channel is None


def test_a_newer_schema_and_unknown_kinds_are_refused_with_what_to_do():
    rec = ev.to_record(ev.WorkerExited("w2", -9, T))
    with pytest.raises(ValueError, match="upgrade hotspare"):
        ev.from_record({**rec, "schema": ev.SCHEMA + 1})
    with pytest.raises(ValueError, match="neither an event nor an outcome"):
        ev.record("worker_teleported", T, {})
    with pytest.raises(ValueError, match="not a coordinator event"):
        ev.from_record(ev.record("recovered", T, {}))
    with pytest.raises(ValueError, match="not a hotspare event record"):
        ev.check_record({"kind": "failure"})


def _failover_ledger():
    """Rank 2 killed at step 15 of a 4-rank job with one warm spare, as the coordinator tells
    its ledger: lost, generation 2 formed from rank 0's state, joined, and every rank commits 15."""
    view = ClusterView(world_size=4, target_spares=1)
    ledger = Ledger({"nproc": 4})
    view.generation, view.members = 1, {r: f"w{r}" for r in range(4)}
    for r in range(4):
        for s in range(15):
            ledger.commit(r, s, 0.05, 1, 4, T + s)
    ledger.fault_injected("w2", T + 15.0)
    ledger.member_lost(2, "w2", -9, T + 15.1, last_step=15, error=None, node_lost=False, spare_was_warm=True)
    return view, ledger


def test_observer_says_a_killed_rank_once_per_stage_with_the_ledgers_own_times():
    view, ledger = _failover_ledger()
    seen = []
    obs = Observer(ledger, view, [seen.append], clock=lambda: T + 99)
    obs.sync()
    obs.sync()
    assert [r["kind"] for r in seen] == ["failure", "generation", "spares"]
    assert seen[0]["t"] == T + 15.1 and seen[0]["data"]["cause"] == "killed" and seen[0]["data"]["step"] == 15
    ledger.formed(FormGeneration(2, {0: "w0", 1: "w1", 2: "w4", 3: "w3"}, 14, 0, (2,), {2: "w4"}), "warm spare",
                  T + 15.2)
    view.generation, view.members = 2, {0: "w0", 1: "w1", 2: "w4", 3: "w3"}
    obs.sync()
    ledger.joined(2, {"rebuild": 0.05, "transfer": 0.02}, 1000, T + 15.3)
    for r in range(4):
        ledger.commit(r, 15, 0.05, 2, 4, T + 15.5)
    obs.sync()
    obs.sync()
    kinds = [r["kind"] for r in seen]
    assert kinds == ["failure", "generation", "spares", "failover", "generation", "recovered"], kinds
    failover, gen, recovered = seen[3:]
    assert failover["t"] == T + 15.2 and failover["data"]["recovery_path"] == "memory"
    assert gen["data"]["placement"][2] == {"rank": 2, "worker": "w4", "node": None, "device": None}
    del gen["data"]["placement"]
    assert gen["data"] == {"gen": 2, "world_size": 4, "members": 4, "failures": 1, "lost_steps": 0, "restore": False}
    assert recovered["t"] == T + 15.5
    assert recovered["data"]["downtime_s"] == pytest.approx(0.5) and recovered["data"]["phases_s"]["decide"] == \
        pytest.approx(0.1)
    assert all(ev.check_record(json.loads(json.dumps(r))) for r in seen)


def test_a_nan_reading_is_written_as_text_and_a_broken_sink_never_stops_the_observer(tmp_path):
    from hotspare.observe.stream import EventFile, read
    path = str(tmp_path / "e.jsonl")
    sink = EventFile(path)
    rec = ev.to_record(ev.Readings([Reading("n0/gpu0", T, "nvml", {"power_w": float("nan")})], T))
    sink(rec)
    sink.close()
    assert read(path)[0]["data"]["readings"][0]["metrics"]["power_w"] == "nan"

    view, ledger = _failover_ledger()
    seen = []

    def broken(rec):
        raise OSError(28, "No space left on device")
    obs = Observer(ledger, view, [broken, seen.append], clock=lambda: T)
    obs.on_event(ev.WorkerExited("w2", -9, T))
    assert broken not in obs.sinks and [r["kind"] for r in seen][:2] == ["worker_exited", "failure"]
