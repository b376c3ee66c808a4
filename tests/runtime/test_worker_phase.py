"""The worker's phase machine (runtime/phase.py), without processes, torch or sockets: each
fault the worker meets is a sequence of events, and the effects must come out in the order
that keeps the step contract (roll back before tearing down, report before waiting, ...)."""
import dataclasses
import subprocess
import sys

import pytest

from hotspare.runtime import phase as ph
from hotspare.runtime.phase import WorkerPhase as P


def gen_order(gen, rank=0, world=4, **extra):
    return ph.Order({"type": "generation", "gen": gen, "rank": rank, "world": world, **extra})


def run(state, *events):
    """Feed ``events``; returns the final state and every effect, in order."""
    effects = []
    for e in events:
        state, out = ph.transition(state, e)
        effects += out
    return state, effects


def kinds(effects):
    return [type(e).__name__ for e in effects]


def stepping(gen=1, rank=2, role="active"):
    s, _ = run(ph.WorkerState(role=role), gen_order(gen, rank), ph.Joined(gen, rank, 4))
    assert s.phase is P.STEPPING
    return s


def test_the_module_is_pure():
    code = ("import sys, hotspare.runtime.phase; "
            "bad = [m for m in ('torch', 'socket', 'hotspare.protocol', 'hotspare.pg') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_phase_is_in_the_table_and_terminal_phases_lead_nowhere():
    assert set(ph.TABLE) == set(P)
    for terminal in (P.HANDING_OFF, P.RELEASED, P.STOPPED):
        assert ph.TABLE[terminal] == frozenset()


def test_a_first_rank_joins_its_generation_then_steps():
    s, eff = run(ph.WorkerState(), gen_order(1, rank=3))
    assert s.phase is P.JOINING and kinds(eff) == ["Join"] and s.taken_gen == 1
    s, eff = run(s, ph.Joined(1, 3, 4))
    assert (s.phase, s.generation, s.rank, s.world, eff) == (P.STEPPING, 1, 3, 4, [])


def test_peer_lost_mid_step_aborts_now_and_recovers_at_the_next_resume_point():
    s = stepping()
    s, eff = run(s, ph.StepFailed(17, "RuntimeError: connection closed"))
    # the group is aborted at once (peers blocked on this rank are freed), nothing else yet:
    # the rest of the loop body runs first and is undone at the top of the next iteration
    assert kinds(eff) == ["AbortGroup"] and eff[0].upto == 1 and s.phase is P.STEPPING and s.recovering
    s, eff = run(s, ph.ResumePoint(committed=16))
    assert s.phase is P.RECOVERING and not s.recovering
    assert kinds(eff) == ["Teardown", "Rollback", "Report", "AwaitOrder"]
    assert eff[1].step == 17
    assert (eff[2].type, eff[2].fields) == ("failed", {"committed": 16, "error": "RuntimeError: connection closed"})
    s, eff = run(s, gen_order(2, rank=2, source=0, receivers=[2], target=16))
    assert s.phase is P.JOINING and kinds(eff) == ["Join"]
    s, _ = run(s, ph.Joined(2, 2, 4))
    assert (s.phase, s.generation) == (P.STEPPING, 2)


def test_a_second_failure_of_the_same_attempt_keeps_the_first_reason():
    s = stepping()
    s, _ = run(s, ph.StepFailed(5, "first"))
    s, eff = run(s, ph.StepFailed(5, "second"))
    assert eff == [] and s.failure.reason == "first"


def test_a_failed_health_vote_does_not_abort_and_reports_the_verdict():
    health = {"kind": "nonfinite", "suspects": [1], "step": 9, "detail": "NaN from rank 1"}
    s, eff = run(stepping(), ph.StepFailed(9, "health vote: NaN from rank 1", health, abort=False))
    assert eff == []
    s, eff = run(s, ph.ResumePoint(committed=8))
    report = eff[2]
    assert report.type == "failed" and report.fields["health"] == health


def test_a_peer_failing_while_joining_is_reported_and_the_next_order_taken():
    s, _ = run(ph.WorkerState(), gen_order(1))
    s, eff = run(s, ph.JoinFailed("connection reset", committed=-1))
    assert s.phase is P.RECOVERING and kinds(eff) == ["Teardown", "Report", "AwaitOrder"]
    assert eff[1].fields == {"committed": -1, "error": "during join: connection reset"}
    s, eff = run(s, gen_order(2))
    assert s.phase is P.JOINING


def test_live_migration_pauses_only_once_the_agreed_step_is_committed():
    s = stepping()
    s, eff = run(s, ph.PauseAsked(1))
    assert eff == [] and s.pause_gen == 1
    s, _ = run(s, ph.PauseAgreed(30))
    s, eff = run(s, ph.ResumePoint(committed=29))         # step 30 not committed yet: go on
    assert eff == [] and s.phase is P.STEPPING
    s, eff = run(s, ph.ResumePoint(committed=30, may_pause=False))   # after the last step: no pause
    assert eff == [] and s.phase is P.STEPPING
    s, eff = run(s, ph.ResumePoint(committed=30))
    assert s.phase is P.PAUSED and kinds(eff) == ["Teardown", "Report", "AwaitOrder"]
    assert (eff[1].type, eff[1].fields) == ("paused", {"committed": 30}) and s.pause_at is None


def test_the_migrated_rank_hands_its_state_off_and_the_others_join_the_next_generation():
    paused, _ = run(stepping(), ph.PauseAgreed(3), ph.ResumePoint(3))
    s, eff = run(paused, ph.Order({"type": "handoff", "gen": 2, "handoff": "h/2", "rank": 2, "world": 4}))
    assert s.phase is P.HANDING_OFF and kinds(eff) == ["HandOff"]
    s, eff = run(paused, gen_order(2))
    assert s.phase is P.JOINING


def test_a_handoff_order_outside_a_pause_is_a_bug():
    with pytest.raises(ph.WorkerPhaseError):
        run(ph.WorkerState(), ph.Order({"type": "handoff", "gen": 1}))


def test_a_failure_takes_precedence_over_a_pause():
    s, _ = run(stepping(), ph.PauseAgreed(5), ph.StepFailed(6, "lost"))
    s, eff = run(s, ph.ResumePoint(5))
    assert s.phase is P.RECOVERING and eff[2].type == "failed" and s.pause_at is None


def test_stale_and_repeated_orders_are_ignored():
    s = stepping(gen=3)
    s, _ = run(s, ph.StepFailed(1, "x"), ph.ResumePoint(0))
    for gen in (1, 3):        # a restarted coordinator repeats its orders
        s2, eff = run(s, gen_order(gen))
        assert s2.phase is P.RECOVERING and kinds(eff) == ["AwaitOrder"]


def test_abort_is_remembered_in_any_phase_and_aborts_the_group():
    s, eff = run(ph.WorkerState(), ph.Aborted(4))
    assert s.aborted_upto == 4 and kinds(eff) == ["AbortGroup"] and s.phase is P.WAITING
    s, eff = run(s, ph.Aborted(2))
    assert s.aborted_upto == 4 and eff[0].upto == 4


def test_done_then_released_or_a_recovery_needs_this_rank():
    fields = {"step": 39, "digest": "d", "rank_digest": "r"}
    done, eff = run(stepping(), ph.Finished(fields))
    assert done.phase is P.DONE and kinds(eff) == ["Report", "AwaitOrder"] and eff[0].fields == fields
    s, eff = run(done, ph.Released())
    assert s.phase is P.RELEASED and eff == []
    s, eff = run(done, gen_order(2))          # a peer failed in the last step
    assert s.phase is P.JOINING


@pytest.mark.parametrize("phase,reason", [(P.RECOVERING, "during recovery"), (P.PAUSED, "live migration"),
                                          (P.WAITING, "before the job started")])
def test_a_release_while_the_job_needs_this_rank_stops_it(phase, reason):
    s = dataclasses.replace(ph.WorkerState(), phase=phase)
    s, eff = run(s, ph.Released())
    assert s.phase is P.STOPPED and kinds(eff) == ["Stop"] and reason in eff[0].reason


def test_a_spare_released_unused_exits_cleanly():
    s, eff = run(ph.WorkerState(role="spare"), ph.Released())
    assert s.phase is P.RELEASED and kinds(eff) == ["ExitSpare"]


def test_a_checkpoint_order_between_generations_is_carried_out_and_waiting_goes_on():
    s = dataclasses.replace(ph.WorkerState(), phase=P.RECOVERING)
    s2, eff = run(s, ph.CheckpointAsked())
    assert s2 == s and kinds(eff) == ["Checkpoint", "AwaitOrder"]


@pytest.mark.parametrize("event", [ph.Joined(1, 0, 4), ph.StepFailed(0, "x"), ph.ResumePoint(0),
                                   ph.Finished({}), ph.PauseAgreed(0)])
def test_training_events_before_joining_are_bugs(event):
    with pytest.raises(ph.WorkerPhaseError):
        run(ph.WorkerState(), event)


def test_orders_while_stepping_are_bugs():
    with pytest.raises(ph.WorkerPhaseError):
        run(stepping(), gen_order(5))


def test_finishing_with_a_failure_pending_is_a_bug():
    s, _ = run(stepping(), ph.StepFailed(3, "x"))
    with pytest.raises(ph.WorkerPhaseError):
        run(s, ph.Finished({}))


def test_every_allowed_move_is_reachable_from_some_event():
    """The table says no more than the transition function does: each allowed move happens."""
    seen = set()
    base = {p: dataclasses.replace(ph.WorkerState(), phase=p) for p in P}
    base[P.STEPPING] = stepping()
    events = [gen_order(9), ph.Order({"type": "handoff", "gen": 9}), ph.Released(), ph.Joined(9, 0, 4),
              ph.JoinFailed("x", 0), ph.ResumePoint(5), ph.Finished({})]
    for p, s in base.items():
        for e in events:
            for st in (s, dataclasses.replace(s, failure=ph.StepFailed(5, "x")),
                       dataclasses.replace(s, pause_at=5), dataclasses.replace(s, role="spare")):
                try:
                    after, _ = ph.transition(st, e)
                except ph.WorkerPhaseError:
                    continue
                if after.phase is not p:
                    seen.add((p, after.phase))
    allowed = {(a, b) for a, to in ph.TABLE.items() for b in to}
    assert seen == allowed
