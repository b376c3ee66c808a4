"""The coordinator without processes: typed events in, commands to a scripted node agent out.

Each event is what the node endpoint decodes from an agent's message (``coordinator.events``);
the node's link is a fake channel that records the commands. So the path event -> signal ->
decide -> execute -> record is seen whole, in milliseconds: ``kill rank 1 at step 3 -> the spare
takes it, state of step 3 from rank 0, the failure recorded as SIGKILL``."""
import copy
import queue
import signal

import pytest

from hotspare.coordinator import Coordinator, FailureRecord, Ledger
from hotspare.coordinator import events as ev
from hotspare.coordinator.nodes import Nodes
from hotspare.errors import ProtocolError
from hotspare.policy import decide as policy
from hotspare.policy.phase import TABLE, JobPhase, PhaseError, advance
from hotspare.policy.signals import FailureCause
from hotspare.protocol.messages import make


class FakeChannel:
    """A node agent's link as the coordinator sees it: every command it sends is kept."""

    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)

    def close(self):
        pass

    def take(self, type_):
        out = [m for m in self.sent if m["type"] == type_]
        self.sent = [m for m in self.sent if m["type"] != type_]
        return out


def delivered(ch, type_):
    """The messages of ``type_`` delivered to workers: {worker: msg}."""
    return {m["worker"]: m["msg"] for m in ch.take("deliver") if m["msg"]["type"] == type_}


def hello(node="n0", devices=("n0/cpu0", "n0/cpu1", "n0/cpu2")):
    return make("agent_hello", node=node, pid=42, devices=list(devices), device_faults=False, proof="00")


def said(who, type_, t=100.0, **fields):
    return ev.WorkerSaid(who, make(type_, **fields), t)


@pytest.fixture
def job():
    """A 2-rank job with one warm spare, generation 1 formed; the coordinator and the node's link."""
    events, ch, lines = queue.Queue(), FakeChannel(), []
    coord = Coordinator(Nodes(), events, policy.ClusterView(world_size=2, target_spares=1), Ledger({}),
                        log=lines.append)
    coord.handle(ev.NodeConnected("n0", hello(), ch, 1.0))
    coord.start(nodes=1)
    spawned = [m["worker"] for m in ch.take("spawn")]
    assert spawned == ["w0", "w1", "w2"]
    for pid, w in enumerate(spawned, 100):
        coord.handle(ev.WorkerStarted(w, pid, 1.0))
        coord.handle(said(w, "ready", worker=w, committed=-1))
    gens = delivered(ch, "generation")
    assert {w: m["rank"] for w, m in gens.items()} == {"w0": 0, "w1": 1}
    assert coord.view.phase is JobPhase.RUNNING and coord.view.generation == 1
    return coord, ch, lines


def test_kill_at_step_3_is_recorded_once_as_sigkill_and_the_spare_takes_the_rank(job):
    coord, ch, lines = job
    for step in range(4):
        for rank, w in ((0, "w0"), (1, "w1")):
            coord.handle(said(w, "commit", t=100.0 + step, gen=1, rank=rank, step=step, dt=0.1))
    coord.handle(ev.WorkerExited("w1", -signal.SIGKILL, 110.0))       # rank 1, in step 4
    assert coord.view.phase is JobPhase.RECOVERING and coord.view.lost == {1}
    (f,) = coord.ledger.failures
    assert (f.cause, f.kind, f.exit_code, f.rank, f.step, f.detected_at) == (
        FailureCause.KILLED, "SIGKILL", -signal.SIGKILL, 1, 4, 110.0)
    assert any(line.startswith("FAILED  rank 1 (w1, pid 101) was killed by SIGKILL at step 4") for line in lines)
    coord.handle(said("w0", "failed", t=111.0, gen=1, rank=0, committed=3, error="peer gone"))
    gens = delivered(ch, "generation")
    assert {w: (m["gen"], m["rank"], m["target"], m["source"]) for w, m in gens.items()} == {
        "w0": (2, 0, 3, 0), "w2": (2, 1, 3, 0)}
    assert [m["role"] for m in ch.take("spawn")] == ["spare"]          # the pool is refilled
    assert (f.generation, f.recovery_path, f.lost_steps, f.replacement, f.source_rank) == (2, "memory", 0, "w2", 0)
    assert f.to_dict()["kind"] == "SIGKILL" and f.to_dict()["cause"] == "killed"
    assert coord.ledger.open == [f]                                    # until the spare commits
    for rank, w in ((0, "w0"), (1, "w2")):
        coord.handle(said(w, "commit", t=112.0, gen=2, rank=rank, step=4, dt=0.1))
    assert coord.ledger.open == [] and f.first_commit_at == 112.0


def test_a_message_of_an_unknown_worker_or_an_unexpected_type_changes_nothing(job, capsys):
    coord, ch, _ = job
    before = copy.deepcopy(coord.view)
    coord.handle(said("w9", "failed", gen=1, rank=0, committed=3, error="x"))      # nobody placed w9
    coord.handle(ev.WorkerSaid("w0", {"v": 1, "type": "generation", "gen": 1}, 1.0))  # not a worker's to say
    coord.handle(said("w0", "done", gen=1, rank=1, step=9, digest="ab"))           # another rank's claim
    assert coord.view == before and ch.sent == []
    err = capsys.readouterr().err
    assert "about unknown worker 'w9'" in err and "unexpected 'generation'" in err
    assert "refusing a message from worker w0" in err


def test_every_worker_message_type_has_one_translation():
    from hotspare.protocol.messages import FROM_WORKER
    coord = Coordinator(Nodes(), queue.Queue(), policy.ClusterView(world_size=1, target_spares=0), Ledger({}),
                        log=lambda line: None)
    assert coord.messages.types() == FROM_WORKER
    with pytest.raises(ProtocolError, match="unexpected 'probe'"):
        coord.messages.translate("w0", make("probe", gen=1), 0.0)


def test_agent_messages_decode_once_into_typed_events():
    now = 50.0
    stamp = lambda t: t      # noqa: E731 -- the endpoint checks the agent's clock here
    cases = [(make("exited", worker="w1", code=-9), ev.WorkerExited("w1", -9, now)),
             (make("started", worker="w1", pid=7), ev.WorkerStarted("w1", 7, now)),
             (make("stopped", worker="w1", stopped=True), ev.WorkerStopped("w1", True, now)),
             (make("injected", worker="w1", fault="kill:rank=1:step=3", id=2, t=49.0),
              ev.FaultInjected("w1", "kill:rank=1:step=3", 2, 49.0)),
             (make("refused", command="spawn", message="no"), ev.AgentRefused("n0", "spawn", "no", now))]
    for msg, event in cases:
        assert ev.decode("n0", msg, stamp, now) == event
    relay = make("relay", worker="w1", t=48.0, msg=make("ready", worker="w1", committed=-1))
    e = ev.decode("n0", relay, stamp, now)
    assert isinstance(e, ev.WorkerSaid) and (e.worker, e.type, e.t) == ("w1", "ready", 48.0)
    with pytest.raises(ProtocolError, match="not an agent message"):
        ev.decode("n0", make("probe", gen=1), stamp, now)
    with pytest.raises(ProtocolError, match="is not a message worker w1 may send"):
        ev.decode("n0", make("relay", worker="w1", t=1.0, msg=make("probe", gen=1)), stamp, now)


# ---------------------------------------------------------------- the fault plug-in seam
def test_without_the_fault_plug_in_an_operator_inject_is_refused_clearly(job):
    coord, ch, lines = job
    replies = []
    coord.handle(ev.OperatorCommand(make("inject", spec="kill:rank=1", operator="op", proof="00"), "operator 'op'",
                                    replies.append, 1.0))
    (reply,) = replies
    assert reply["ok"] is False and "--allow-inject" in reply["message"]
    assert ch.sent == [] and any(line.startswith("OPERATOR refused inject") for line in lines)


def test_with_the_fault_plug_in_an_operator_inject_is_armed_on_every_node_and_its_firing_recorded():
    from hotspare.testing.faults import CoordinatorFaults, parse
    ch, lines, replies = FakeChannel(), [], []
    coord = Coordinator(Nodes(), queue.Queue(), policy.ClusterView(world_size=2, target_spares=0), Ledger({}),
                        log=lines.append, plugins=[CoordinatorFaults([parse("kill:rank=0:step=5")])])
    coord.handle(ev.NodeConnected("n0", hello(), ch, 1.0))
    assert [(m["spec"], m["running"]) for m in ch.take("arm")] == [("kill:rank=0:step=5", False)]
    for spec, ok in (("kill:rank=7", False), ("kill:rank=1", True)):
        coord.handle(ev.OperatorCommand(make("inject", spec=spec, operator="op", proof="00"), "operator 'op'",
                                        replies.append, 1.0))
        assert replies.pop()["ok"] is ok
    assert [m["spec"] for m in ch.take("arm")] == ["kill:rank=1"]
    coord.start(nodes=1)
    coord.handle(ev.WorkerStarted("w1", 101, 1.0))
    coord.handle(ev.FaultInjected("w1", "kill:rank=1", 1, 7.0))
    assert coord.ledger.fault_at == {"w1": 7.0}
    assert "FAULT   injected kill:rank=1 -> SIGKILL to worker w1 (pid 101)" in lines


# ---------------------------------------------------------------- records
@pytest.mark.parametrize("cause, code, rule, kind", [
    (FailureCause.KILLED, -signal.SIGKILL, "", "SIGKILL"), (FailureCause.EXITED, 7, "", "exit 7"),
    (FailureCause.HEALTH, -signal.SIGKILL, "ecc-uncorrectable", "health:ecc-uncorrectable"),
    (FailureCause.HANG, -signal.SIGKILL, "", "hang"), (FailureCause.NODE_LOST, -signal.SIGKILL, "", "node lost"),
    (FailureCause.EXCEPTION, 1, "", "exception"), (FailureCause.COLLECTIVE, None, "", "collective error")])
def test_a_failure_record_names_its_cause_as_the_report_always_did(cause, code, rule, kind):
    assert FailureRecord(cause, 0, "w0", 3, 1.0, exit_code=code, rule=rule).kind == kind


def test_a_fenced_worker_is_recorded_as_fenced_when_the_detector_fired():
    ledger = Ledger({})
    ledger.fenced("w1", 5.0, FailureCause.HEALTH, "nonfinite")
    rec = ledger.member_lost(1, "w1", -signal.SIGKILL, 6.0, last_step=3, error=None, node_lost=False,
                             spare_was_warm=True)
    assert (rec.kind, rec.detected_at, rec.step) == ("health:nonfinite", 5.0, 3)


# ---------------------------------------------------------------- the job's lifecycle
def test_the_phase_table_allows_only_the_documented_moves_and_the_ends_are_terminal():
    allowed = {(a, b) for a, targets in TABLE.items() for b in targets}
    assert allowed == {(JobPhase.STARTING, JobPhase.RUNNING), (JobPhase.STARTING, JobPhase.STOPPED),
                       (JobPhase.RUNNING, JobPhase.RECOVERING), (JobPhase.RUNNING, JobPhase.FINISHED),
                       (JobPhase.RUNNING, JobPhase.STOPPED), (JobPhase.RECOVERING, JobPhase.RUNNING),
                       (JobPhase.RECOVERING, JobPhase.FINISHED), (JobPhase.RECOVERING, JobPhase.STOPPED)}
    for a in JobPhase:
        assert advance(a, a) is a
        for b in JobPhase:
            if a is not b and (a, b) not in allowed:
                with pytest.raises(PhaseError):
                    advance(a, b)
    assert {p for p in JobPhase if p.over} == {JobPhase.FINISHED, JobPhase.STOPPED}
    assert {p for p in JobPhase if p.active} == {JobPhase.RUNNING, JobPhase.RECOVERING}


def test_a_stopped_job_is_never_released_afterwards():
    v = policy.ClusterView(world_size=1, target_spares=0)
    policy.apply(v, policy.Stop(1, "bug"))
    with pytest.raises(PhaseError, match="stopped -> finished"):
        policy.apply(v, policy.Release("done"))


def test_the_production_path_imports_no_fault_injection_and_the_policy_no_torch():
    """Coordinator and node agent run without the testing plug-in; the policy (shared with the
    simulator) imports neither torch nor sockets."""
    import subprocess
    import sys
    probe = ("import sys, hotspare.coordinator, hotspare.coordinator.control, hotspare.agent, hotspare.agent.remote\n"
             "print(sorted(m for m in sys.modules if m.startswith('hotspare.testing')))\n"
             "for m in [m for m in sys.modules if m.startswith('hotspare')]: sys.modules.pop(m)\n"
             "sys.modules.pop('socket', None)\n"
             "import hotspare.policy.decide, hotspare.policy.phase\n"
             "print('torch' in sys.modules, 'socket' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "False False"], out


def test_a_step_a_rank_holds_committed_without_its_commit_report_counts_as_completed():
    """A step whose optimizer stepped before a later collective of its block failed is committed
    on that rank with no commit report sent (runtime/steps.py): its failed (or paused) report
    says so, and the steps completed then agree with the state a checkpoint or source takes from
    it (a paused lender's checkpoint of step 105 with "104 committed" was the symptom)."""
    ledger = Ledger({})
    ledger.commit(0, 104, 0.1, 1, 1, 0.0)
    ledger.holds(0, 105)
    assert ledger.report()["steps_completed"] == 106
    ledger.holds(0, 103)                      # an older report never lowers it
    assert ledger.report()["steps_completed"] == 106
    ledger.commit(0, 106, 0.1, 2, 1, 1.0)
    r = ledger.report()
    assert r["steps_completed"] == 107 and r["steps_repeated"] == 0
