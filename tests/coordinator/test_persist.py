"""A coordinator's state survives a restart as JSON, and nothing read back runs code."""
import json

import pytest

from hotspare.coordinator import persist
from hotspare.coordinator.ledger import FailureRecord, Ledger
from hotspare.coordinator.nodes import Worker
from hotspare.errors import ProtocolError
from hotspare.policy.actions import Pause, Regrow
from hotspare.policy.phase import JobPhase
from hotspare.policy.signals import Checkpointed, Crashed, FailureCause
from hotspare.policy.view import ClusterView


def busy_view() -> ClusterView:
    v = ClusterView(world_size=4, target_spares=1, generation=3, phase=JobPhase.RECOVERING,
                    members={0: "w0", 1: "w1", 2: "w5", 3: "w3"}, ready_spares=["w6"], lost={2},
                    reports={0: 41, 1: 41}, ready_workers={"w0", "w1", "w3", "w5", "w6"},
                    crashes=[Crashed("w2", 2, 1, 17, "boom", "tb")],
                    checkpoint=Checkpointed(40, "/ckpt/step-40"), fenced={1},
                    health_failures={(2, 17): ["w2"]},
                    migrating=Pause(gen=3, rank=1, spare="w6", device="h/cpu1", reason="hot", rule="thermal"))
    return v


def test_a_view_and_a_ledger_come_back_equal():
    view = busy_view()
    ledger = Ledger({"script": "train.py", "nproc": 4})
    ledger.commit(0, 5, 0.1, 1, 4, 10.0)
    ledger.commit(0, 5, 0.1, 1, 4, 10.5)           # a repeated step: a set of tuples
    ledger.failures.append(FailureRecord(cause=FailureCause.NODE_LOST, rank=2, worker="w2", step=17,
                                         detected_at=12.0))
    ledger.fenced("w1", 11.0, FailureCause.HANG, why="no step committed for 9.0 s")
    data = json.loads(json.dumps({"v": persist.encode(view), "l": persist.encode(ledger)}))
    assert persist.decode(data["v"]) == view
    back = persist.decode(data["l"])
    assert back == ledger and back.seen == {(0, 5)} and back.repeated == {5}
    assert back.fences["w1"] == (11.0, FailureCause.HANG, "", "no step committed for 9.0 s")


def test_an_elastic_jobs_placement_and_regrow_come_back_equal():
    view = ClusterView(world_size=3, target_spares=0, generation=2, phase=JobPhase.RECOVERING,
                       members={0: "w0", 1: "w2"}, elastic_min=1, placement=(0, 0, 1),
                       regrowing=Regrow(gen=2, vrank=1, spare="w3", placement=(0, 1, 2), reason="spare ready"))
    assert persist.decode(json.loads(json.dumps(persist.encode(view)))) == view


@pytest.mark.parametrize("bad", [
    {"$type": "Popen", "args": ["sh"]},                       # not a type the coordinator persists
    {"$enum": "Signals", "value": 9},
    {"$type": "Worker", "worker": "w0", "node": "a", "role": "active", "rank": 0, "device": None, "evil": 1},
])
def test_anything_it_did_not_write_is_refused(bad):
    with pytest.raises(ProtocolError):
        persist.decode(bad)


def test_a_type_outside_the_list_is_not_written_either():
    class Other:
        pass
    with pytest.raises(TypeError):
        persist.encode(Other())
    worker = Worker("w0", "a", "active", 0, "a/cpu0", pid=7)
    assert persist.decode(persist.encode(worker)) == worker


def test_an_open_failure_is_the_same_record_as_the_reports_after_a_restore():
    """The ledger closes a failure through its open list: after a restore that must still be the
    report's record, not a copy (a restarted service's failover must show in the report)."""
    from hotspare.coordinator import Coordinator
    from hotspare.coordinator.nodes import Nodes

    def coordinator():
        ledger = Ledger({})
        return Coordinator(Nodes(job="j1"), None, ClusterView(world_size=2, target_spares=1), ledger, log=lambda s: None)

    before = coordinator()
    rec = before.ledger.member_lost(1, "j1.w1", -9, 5.0, 10, None, False, True)
    assert before.ledger.open == [rec]
    after = coordinator()
    persist.restore(after, json.loads(json.dumps(persist.capture(before))))
    assert after.ledger.open[0] is after.ledger.failures[0]
