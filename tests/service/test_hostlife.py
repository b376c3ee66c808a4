"""A host's lifecycle in the coordinator service (pure): it serves job after job, a late or
stale word changes nothing, a cancelled placement gives it back, a lost link is gone."""
import pytest

from hotspare.service import hostlife as life
from hotspare.service.hostlife import Agent, HostPhase, HostState, transition


def run(events, state=HostState(), t=0.0):
    for event in events:
        state, _ = transition(state, event, t)
    return state


def test_a_host_serves_three_jobs_one_after_another():
    state = run([life.Registered()])
    for job in ("j1", "j2", "j3"):
        state = run([life.Reserved(job), life.Assigned(job)], state)
        assert state == HostState(HostPhase.BUSY, job, 0.0) and state.describe() == f"job {job}"
        state = run([life.JobEnded(job, released=False), life.Released(job)], state)
        assert state.phase is HostPhase.IDLE and state.job is None


def test_a_job_that_ended_before_its_agent_released_waits_for_it_and_an_agent_that_never_does_is_cut_off():
    state = run([life.Registered(), life.Reserved("j1"), life.Assigned("j1"), life.JobEnded("j1", False)])
    assert state.phase is HostPhase.RELEASING and state.describe() == "releasing (j1 ended)"
    assert transition(state, life.Tick(), life.RELEASE_WAIT_S - 1)[0] == state
    assert run([life.Released("j1")], state).phase is HostPhase.IDLE
    later, why = transition(state, life.Tick(), life.RELEASE_WAIT_S)
    assert later.phase is HostPhase.GONE and "did not say released" in why      # never placed again as it is


def test_a_late_or_stale_release_changes_nothing():
    busy = run([life.Registered(), life.Reserved("j2"), life.Assigned("j2")])
    assert transition(busy, life.Released("j1"), 1.0)[0] == busy           # the job before's
    assert transition(busy, life.JobEnded("j1", True), 1.0)[0] == busy
    idle = run([life.Registered()])
    assert transition(idle, life.Released("j1"), 1.0)[0] == idle


def test_a_job_cancelled_while_its_store_starts_gives_its_hosts_back_untold():
    state = run([life.Registered(), life.Reserved("j1"), life.Unreserved("j1")])
    assert state.phase is HostPhase.IDLE


def test_a_lost_link_is_gone_from_any_phase_and_registering_again_makes_it_idle_or_its_jobs():
    for events in ([life.Registered()], [life.Registered(), life.Reserved("j1")],
                   [life.Registered(), life.Reserved("j1"), life.Assigned("j1")],
                   [life.Registered(), life.Reserved("j1"), life.Assigned("j1"), life.JobEnded("j1", False)]):
        gone = run([*events, life.LinkLost()])
        assert gone.phase is HostPhase.GONE and gone.job is None
        assert run([life.Registered()], gone).phase is HostPhase.IDLE
        assert run([life.Registered("j1")], gone) == HostState(HostPhase.BUSY, "j1", 0.0)   # resumed after a restart


@pytest.mark.parametrize("events", [
    [life.Reserved("j1")],                                           # a host not registered
    [life.Registered(), life.Reserved("j1"), life.Reserved("j2")],   # reserved twice
    [life.Registered(), life.Reserved("j1"), life.Assigned("j2")],   # given to another job than reserved for
    [life.Registered(), life.Reserved("j1"), life.Assigned("j1"), life.Assigned("j2")],   # a busy host placed
    [life.Registered(), life.Registered()],                          # registered twice
    [life.Registered(), life.Reserved("j1"), life.LinkLost(), life.Assigned("j1")],   # left while reserved
])
def test_moves_the_table_does_not_allow_are_bugs(events):
    with pytest.raises(life.HostPhaseError):
        run(events)


def test_every_phase_has_its_row_and_gone_is_reachable_from_each():
    assert set(life.TABLE) == set(HostPhase)
    assert all(HostPhase.GONE in moves for phase, moves in life.TABLE.items() if phase is not HostPhase.GONE)


def test_the_next_jobs_setup_gets_everything_the_agent_said():
    """The bug: a host back from its first job was rebuilt without device_faults and pid."""
    agent = Agent.from_hello({"node": "hosta", "pid": 41, "devices": ["hosta/cpu0", "hosta/cpu1"],
                              "device_faults": True, "spare": False, "job": "", "nonce": "x"})
    hello = agent.hello(["hosta/cpu1"])
    assert hello == {"node": "hosta", "pid": 41, "devices": ["hosta/cpu1"], "device_faults": True, "spare": False}
    from hotspare.coordinator.nodes import Nodes
    for job in ("j1", "j2"):                         # each job's coordinator takes the host in from it
        node = Nodes(job=job).add(hello, channel=None)
        assert node.device_faults and node.pid == 41 and node.devices == ["hosta/cpu1"]
    with pytest.raises(ValueError, match="spare"):
        Agent.from_hello({"node": "h", "pid": 1, "devices": [], "device_faults": False, "spare": "yes"})
