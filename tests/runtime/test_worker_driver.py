"""The driver of the worker's phase machine (runtime/driver.py) over a scripted control link and
a recording membership, torchft-style: no processes, no process group; the coordinator's orders
come from a list, a peer's failure is an exception raised on cue."""
import threading

import pytest
import torch.distributed as dist

from hotspare.errors import JobFailed, StateMismatch
from hotspare.runtime import phase as ph
from hotspare.runtime.driver import WorkerDriver
from hotspare.runtime.phase import WorkerPhase as P


class ScriptedLink:
    def __init__(self, orders):
        self.orders = list(orders)
        self.sent = []

    def next_order(self):
        return self.orders.pop(0)

    def send(self, type_, **fields):
        self.sent.append((type_, fields))


class RecordingMembers:
    """Membership's side of the driver; ``fail_joins``: how many joins a peer's failure breaks."""

    class _Progress:
        committed = 7

    def __init__(self, fail_joins=0, error=None):
        self.calls, self.fail_joins, self.error = [], fail_joins, error
        self.generation, self.rank, self.world_size = 0, None, 1
        self.progress = self._Progress()
        self.broken = False

    def join(self, msg):
        self.calls.append(("join", msg["gen"]))
        if self.error is not None:
            raise self.error
        if self.fail_joins:
            self.fail_joins -= 1
            raise dist.DistNetworkError("connection reset by peer")
        self.generation, self.rank, self.world_size = msg["gen"], msg["rank"], msg["world"]

    def teardown(self):
        self.calls.append(("teardown",))

    def abort_upto(self, upto):
        self.calls.append(("abort", upto))

    def handoff(self, msg):
        self.calls.append(("handoff", msg["gen"]))
        raise SystemExit(0)          # the real one exits the process


def order(gen, rank=1, world=4):
    return {"type": "generation", "gen": gen, "rank": rank, "world": world}


def driver(orders, members=None, role="active"):
    link, members = ScriptedLink(orders), members or RecordingMembers()
    rollbacks, checkpoints = [], []
    d = WorkerDriver(link, members, role=role, rollback=rollbacks.append, checkpoint=lambda: checkpoints.append("written"))
    d.trace = []
    return d, link, members, rollbacks, checkpoints


def test_start_joins_the_first_generation():
    d, link, members, *_ = driver([order(1)])
    d.await_order()
    assert d.phase is P.STEPPING and members.calls == [("join", 1)] and link.sent == []


def test_peer_lost_then_recovered_at_the_resume_point_in_the_contract_order():
    d, link, members, rollbacks, _ = driver([order(1), order(2)])
    d.await_order()
    d.handle(ph.StepFailed(12, "RuntimeError: connection closed"))
    assert members.calls[-1] == ("abort", 1) and d.recovering and rollbacks == []
    d.handle(ph.ResumePoint(committed=11))
    assert rollbacks == [12]
    assert members.calls == [("join", 1), ("abort", 1), ("teardown",), ("join", 2)]   # torn down, then rolled back
    assert link.sent == [("failed", {"gen": 1, "rank": 1, "committed": 11, "error": "RuntimeError: connection closed"})]
    assert d.phase is P.STEPPING and d.state.generation == 2 and not d.recovering


def test_a_peer_failing_during_the_join_is_reported_and_the_next_generation_joined():
    members = RecordingMembers(fail_joins=1)
    d, link, members, *_ = driver([order(1), order(2)], members)
    d.await_order()
    assert [t for t, _ in link.sent] == ["failed"]
    assert link.sent[0][1]["error"].startswith("during join: connection reset")
    assert link.sent[0][1]["committed"] == 7
    assert d.phase is P.STEPPING and members.calls == [("join", 1), ("teardown",), ("join", 2)]


def test_a_state_mismatch_while_joining_is_a_bug_not_a_recovery():
    members = RecordingMembers(error=StateMismatch("source holds step 3"))
    d, *_ = driver([order(1)], members)
    with pytest.raises(StateMismatch):
        d.await_order()


def test_a_release_during_recovery_stops_the_job_with_the_reason():
    d, link, *_ = driver([order(1), {"type": "release", "reason": "no capacity"}])
    d.await_order()
    d.handle(ph.StepFailed(3, "lost"))
    with pytest.raises(JobFailed, match="during recovery"):
        d.handle(ph.ResumePoint(2))
    assert d.phase is P.STOPPED


def test_a_checkpoint_order_while_waiting_is_written_then_the_order_taken():
    d, _, _, _, checkpoints = driver([{"type": "checkpoint_now"}, order(1)])
    d.await_order()
    assert checkpoints == ["written"] and d.phase is P.STEPPING


def test_live_migration_the_migrated_rank_hands_off():
    handoff = {"type": "handoff", "gen": 2, "handoff": "h", "rank": 1, "world": 4}
    d, link, members, *_ = driver([order(1), handoff])
    d.await_order()
    d.notify(ph.PauseAsked(1))
    assert d.state.pause_gen == 1
    d.handle(ph.PauseAgreed(5))
    d.handle(ph.ResumePoint(4))
    assert d.phase is P.STEPPING
    with pytest.raises(SystemExit):
        d.handle(ph.ResumePoint(5))
    assert link.sent == [("paused", {"gen": 1, "rank": 1, "committed": 5})]
    assert members.calls[-2:] == [("teardown",), ("handoff", 2)] and d.phase is P.HANDING_OFF


def test_done_then_released():
    d, link, *_ = driver([order(1), {"type": "release"}])
    d.await_order()
    d.handle(ph.Finished({"step": 9, "digest": "a", "rank_digest": "b"}))
    assert d.phase is P.RELEASED
    assert link.sent == [("done", {"gen": 1, "rank": 1, "step": 9, "digest": "a", "rank_digest": "b"})]


def test_an_abort_from_the_reader_thread_reaches_the_group_while_the_training_thread_waits():
    d, _, members, *_ = driver([order(1)])
    d.await_order()
    t = threading.Thread(target=d.notify, args=(ph.Aborted(1),))
    t.start()
    t.join()
    assert members.calls[-1] == ("abort", 1) and d.state.aborted_upto == 1 and d.phase is P.STEPPING


def test_the_trace_names_each_event_and_the_phase_after_it():
    d, *_ = driver([order(1), order(2)])
    d.await_order()
    d.handle(ph.StepFailed(1, "x"))
    d.handle(ph.ResumePoint(0))
    assert d.trace == [("Order", "joining"), ("Joined", "stepping"), ("StepFailed", "stepping"),
                       ("ResumePoint", "recovering"), ("Order", "joining"), ("Joined", "stepping")]


def test_a_transport_error_in_the_state_transfer_is_a_peer_failure():
    class Members(RecordingMembers):
        def join(self, msg):
            super().join(msg)
            if msg["gen"] == 1:
                raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 5000ms for send")

    d, link, *_ = driver([order(1), order(2)], Members())
    d.await_order()
    assert link.sent[0][0] == "failed" and "Timed out waiting" in link.sent[0][1]["error"]
    assert d.phase is P.STEPPING and d.state.generation == 2


def test_a_bug_in_the_join_is_raised_not_recovered():
    d, *_ = driver([order(1)], RecordingMembers(error=TypeError("bad argument")))
    with pytest.raises(TypeError):
        d.await_order()
