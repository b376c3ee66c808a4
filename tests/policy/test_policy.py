"""The coordinator's decisions, scripted without processes: signal in, actions and reason out."""
import copy

from hotspare.policy.decide import (AbortGeneration, Checkpointed, CheckpointNow, ClusterView,
                                    Crashed, Done, Fence, FormGeneration, Release, StartSpares,
                                    StepFailed, Stop, Tick, WorkerExited, WorkerReady, decide,
                                    observe)
from hotspare.policy.phase import JobPhase
from hotspare.testing.decisions import feed
from hotspare.policy.hang import RankActivity, threshold
from hotspare.policy.recovery import plan_recovery


def running_view(world=4, spares=1):
    v = ClusterView(world_size=world, target_spares=spares)
    for r in range(world):
        feed(v, WorkerReady(f"w{r}", "active", r))
    for s in range(spares):
        feed(v, WorkerReady(f"s{s}", "spare"))
    assert v.phase is JobPhase.RUNNING and v.generation == 1
    return v


def test_first_generation_forms_when_all_ranks_ready_and_syncs_from_rank_0():
    v = ClusterView(world_size=3, target_spares=0)
    assert feed(v, WorkerReady("w0", "active", 0)).actions == ()
    feed(v, WorkerReady("w1", "active", 1))
    d = feed(v, WorkerReady("w2", "active", 2))
    (form,) = d.actions
    assert form == FormGeneration(1, {0: "w0", 1: "w1", 2: "w2"}, -1, 0, (1, 2))
    assert "initial state from rank 0" in d.reason


def test_kill_at_step_30_spare_replaces_rank_and_state_comes_from_most_advanced_survivor():
    v = running_view()
    d = feed(v, WorkerExited("w2", -9, "was killed by SIGKILL"))
    assert d.actions == () and "waiting for ranks [0, 1, 3]" in d.reason
    d = tick(v, stalled=0, recovering=0.6)      # the backstop: survivors still silent get an abort
    assert d.actions == (AbortGeneration(1, (0, 1, 3)),)
    feed(v, StepFailed("w0", 0, 1, 30))
    feed(v, StepFailed("w1", 1, 1, 29))       # failed mid-allreduce: one step behind
    d = feed(v, StepFailed("w3", 3, 1, 30))
    form, refill = d.actions
    assert form.gen == 2 and form.members == {0: "w0", 1: "w1", 2: "s0", 3: "w3"}
    assert (form.target, form.source, form.receivers) == (30, 0, (1, 2))
    assert refill == StartSpares(1)
    assert "state of step 30 comes from rank 0" in d.reason and "one step behind" in d.reason
    assert v.phase is JobPhase.RUNNING and v.generation == 2 and v.ready_spares == []


def test_no_warm_spare_starts_a_cold_one_and_recovers_when_it_is_ready():
    v = running_view(spares=0)
    feed(v, WorkerExited("w1", -9))
    for r in (0, 2, 3):
        d = feed(v, StepFailed(f"w{r}", r, 1, 7))
    assert d.actions == (StartSpares(1),) and "cold" in d.reason
    d = feed(v, WorkerReady("w9", "spare"))
    assert isinstance(d.actions[0], FormGeneration) and d.actions[0].members[1] == "w9"
    assert len(d.actions) == 1          # --spares 0: nothing to re-provision


def test_same_step_raising_again_on_the_replacement_stops_as_a_bug():
    v = running_view()
    d = feed(v, Crashed("w1", 1, 1, 5, "ValueError: boom", "Traceback...\nValueError: boom"))
    assert d.actions == () and "failing over once" in d.reason
    feed(v, WorkerExited("w1", 1))
    for r in (0, 2, 3):
        feed(v, StepFailed(f"w{r}", r, 1, 4))
    d = feed(v, Crashed("s0", 1, 2, 5, "ValueError: boom", "Traceback...\nValueError: boom"))
    (stop,) = d.actions
    assert isinstance(stop, Stop) and "bug in the training script" in stop.message
    assert "ValueError: boom" in stop.message and v.phase is JobPhase.STOPPED


def test_repeated_collective_failure_without_a_dead_worker_stops():
    v = running_view()
    for _ in range(2):
        for r in range(4):
            d = feed(v, StepFailed(f"w{r}" if r != 2 else "w2", r, v.generation, 9))
        assert isinstance(d.actions[0], FormGeneration)
    for r in range(4):
        d = feed(v, StepFailed(f"w{r}", r, v.generation, 9))
    assert isinstance(d.actions[0], Stop) and "no worker died" in d.actions[0].message


def test_release_when_every_rank_is_done_and_spare_exit_is_replaced():
    v = running_view()
    d = feed(v, WorkerExited("s0", -9))
    assert d.actions == (StartSpares(1),)
    for r in range(4):
        d = feed(v, Done(f"w{r}", r, 1, 99, "abc"))
    assert isinstance(d.actions[0], Release) and v.phase is JobPhase.FINISHED


def test_worker_failing_before_ready_stops_with_startup_message():
    v = ClusterView(world_size=2, target_spares=1)
    d = feed(v, WorkerExited("w0", 2, "exited with code 2"))
    assert isinstance(d.actions[0], Stop) and "failed to start" in d.actions[0].message


def test_stale_generation_reports_are_ignored():
    v = running_view()
    feed(v, StepFailed("w0", 0, 0, 3))     # generation 0 never existed now
    assert v.phase is JobPhase.RUNNING and v.reports == {}


def test_plan_recovery_paths():
    assert plan_recovery({1}, {0: 5, 2: 5}, warm_spares=1).path == "memory"
    p = plan_recovery({1, 2}, {0: 5}, warm_spares=1)
    assert p.path == "wait" and p.start == 1
    assert plan_recovery({0, 1}, {}, 3, checkpoint_step=40).path == "checkpoint"
    assert plan_recovery({0, 1}, {}, 3).path == "stop"


def tick(v, stalled, recovering=0.0, limit=2.0, stopped=(), reducing=None):
    acts = tuple(RankActivity(r, 10, (reducing or {}).get(r, 10), r in stopped) for r in sorted(v.members))
    return feed(v, Tick(acts, stalled, recovering, limit))


def test_hang_detection_fences_the_stopped_or_lagging_rank_never_a_slow_one():
    v = running_view()
    assert tick(v, stalled=1.9).actions == ()                      # slow but under the threshold
    d = tick(v, stalled=2.5, stopped=(2,))
    assert d.actions == (Fence((2,), d.reason),) and "stopped" in d.reason
    v = running_view()
    d = tick(v, stalled=3.0, reducing={0: 10, 1: 10, 2: 9, 3: 10})
    assert d.actions[0].ranks == (2,) and "never reached the gradient exchange" in d.reason
    v = running_view()
    d = tick(v, stalled=3.0)                                       # nobody stands out
    assert isinstance(d.actions[0], AbortGeneration) and tick(v, stalled=3.5).actions == ()


def test_ranks_blocked_behind_a_rank_being_fenced_are_not_fenced_too():
    # Rank 3 hangs before DDP's buffer broadcast; ranks 0 and 1 wait in the broadcast, rank 2
    # got its buffers and waits in the gradient exchange. Rank 3 is fenced; until its exit
    # starts the recovery (which frees the others), nobody else is judged.
    v = running_view()
    d = tick(v, stalled=2.1, stopped=(3,))
    assert d.actions == (Fence((3,), d.reason),)
    d = tick(v, stalled=2.4, reducing={0: 9, 1: 9, 2: 10, 3: 9})
    assert d.actions == () and "waiting for fenced rank(s) [3]" in d.reason


def test_silent_survivor_is_fenced_during_recovery():
    v = running_view()
    feed(v, WorkerExited("w1", -9))
    feed(v, StepFailed("w0", 0, 1, 5))
    feed(v, StepFailed("w2", 2, 1, 5))
    assert tick(v, stalled=0, recovering=1.0).actions == (AbortGeneration(1, (3,)),)
    assert tick(v, stalled=0, recovering=1.5).actions == ()
    assert tick(v, stalled=0, recovering=2.5).actions[0].ranks == (3,)


def test_thresholds_adapt_to_step_time():
    assert threshold([], floor=2, factor=10) == 20                  # before the first commit
    assert threshold([0.01] * 10, floor=2, factor=10) == 2
    assert threshold([1.0] * 10, floor=2, factor=10) == 10


def test_every_rank_lost_falls_back_to_the_newest_checkpoint():
    v = running_view(spares=1)
    feed(v, Checkpointed(20, "/ck/step-000000020"))
    for r in range(4):
        d = feed(v, WorkerExited(f"w{r}", -9))
    assert d.actions[-1] == StartSpares(3) and "checkpoint at step 20" in d.reason
    for i in range(3):
        d = feed(v, WorkerReady(f"c{i}", "spare"))
    form = d.actions[0]
    assert form.restore == "/ck/step-000000020" and form.target == 20 and set(form.members) == {0, 1, 2, 3}


def test_no_capacity_stops_cleanly_after_a_last_checkpoint():
    v = running_view(spares=0)
    v.replacements_left, v.capacity_wait = 0, 5.0
    feed(v, WorkerExited("w1", -9))
    for r in (0, 2, 3):
        feed(v, StepFailed(f"w{r}", r, 1, 7))
    assert tick(v, stalled=0, recovering=4.0, limit=100).actions == ()
    d = tick(v, stalled=0, recovering=5.0, limit=100)
    assert d.actions == (CheckpointNow(0, v.stopping),)
    d = feed(v, Checkpointed(7, "/ck/step-000000007"))
    assert isinstance(d.actions[0], Stop) and "--resume /ck" in d.actions[0].message


def test_when_no_survivor_reports_the_wait_is_longer_but_bounded():
    v = running_view()
    feed(v, WorkerExited("w1", -9))
    assert isinstance(tick(v, stalled=0, recovering=0.6).actions[0], AbortGeneration)
    assert tick(v, stalled=0, recovering=2.5).actions == ()      # nobody reported: be patient
    d = tick(v, stalled=0, recovering=6.0)                         # ...but never forever
    assert d.actions[0].ranks == (0, 2, 3)


def test_a_survivor_that_never_received_the_state_is_not_a_copy():
    # ranks 0-2 were fenced; rank 3 is a spare that joined but never got the state (-1)
    p = plan_recovery({0, 1, 2}, {3: -1}, warm_spares=3, job_step=263)
    assert p.path == "stop" and set(p.receivers) == {0, 1, 2, 3}
    p = plan_recovery({0, 1, 2}, {3: -1}, warm_spares=3, checkpoint_step=200, job_step=263)
    assert p.path == "checkpoint" and p.target_step == 200
    p = plan_recovery({1}, {0: 262, 2: 263, 3: -1}, warm_spares=1, job_step=263)
    assert (p.path, p.source, p.receivers) == ("memory", 2, (0, 1, 3))   # one step behind still counts


def test_decide_is_pure_the_same_view_and_signal_give_the_same_decision_and_leave_the_view_alone():
    from hotspare.policy.decide import HealthVerdict
    v = running_view()
    verdict = HealthVerdict("host/cpu1", 1, "failover", "NaN", False, "nonfinite", step=12, worker="w1")
    observe(v, verdict)
    assert v.health_failures == {(1, 12): ["w1"]}       # observe records the fact, once
    frozen = copy.deepcopy(v)
    first, again = decide(v, verdict), decide(v, verdict)
    assert first == again and v == frozen              # decide, twice: no trace in the view
    assert isinstance(first.actions[0], Fence)


def test_the_hang_threshold_is_lenient_while_a_generation_forms():
    from hotspare.policy.hang import lenient
    assert lenient(2.0, 5.0, recovering=True, forming=True) == 12.0      # between generations
    assert lenient(2.0, 5.0, recovering=False, forming=True) == 7.0      # joined, no step committed yet
    assert lenient(2.0, 5.0, recovering=False, forming=False) == 2.0     # running: the plain threshold
