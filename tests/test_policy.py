"""The coordinator's decisions, scripted without processes: signal in, actions and reason out."""
from hotspare.policy.decide import (AbortGeneration, ClusterView, Crashed, Done, FormGeneration,
                                    Release, StartSpares, StepFailed, Stop, WorkerExited,
                                    WorkerReady, apply, decide, observe)
from hotspare.policy.recovery import plan_recovery


def feed(view, sig):
    observe(view, sig)
    d = decide(view, sig, 0.0)
    for a in d.actions:
        apply(view, a)
    return d


def running_view(world=4, spares=1):
    v = ClusterView(world_size=world, total_steps=100, target_spares=spares)
    for r in range(world):
        feed(v, WorkerReady(f"w{r}", "active", r))
    for s in range(spares):
        feed(v, WorkerReady(f"s{s}", "spare"))
    assert v.phase == "running" and v.generation == 1
    return v


def test_first_generation_forms_when_all_ranks_ready_and_syncs_from_rank_0():
    v = ClusterView(world_size=3, total_steps=10, target_spares=0)
    assert feed(v, WorkerReady("w0", "active", 0)).actions == ()
    feed(v, WorkerReady("w1", "active", 1))
    d = feed(v, WorkerReady("w2", "active", 2))
    (form,) = d.actions
    assert form == FormGeneration(1, {0: "w0", 1: "w1", 2: "w2"}, -1, 0, (1, 2))
    assert "initial state from rank 0" in d.reason


def test_kill_at_step_30_spare_replaces_rank_and_state_comes_from_most_advanced_survivor():
    v = running_view()
    d = feed(v, WorkerExited("w2", -9, "was killed by SIGKILL"))
    assert d.actions == (AbortGeneration(1, (0, 1, 3)),)
    assert "waiting for ranks [0, 1, 3]" in d.reason
    feed(v, StepFailed("w0", 0, 1, 30))
    feed(v, StepFailed("w1", 1, 1, 29))       # failed mid-allreduce: one step behind
    d = feed(v, StepFailed("w3", 3, 1, 30))
    form, refill = d.actions
    assert form.gen == 2 and form.members == {0: "w0", 1: "w1", 2: "s0", 3: "w3"}
    assert (form.target, form.source, form.receivers) == (30, 0, (1, 2))
    assert refill == StartSpares(1)
    assert "state of step 30 comes from rank 0" in d.reason and "one step behind" in d.reason
    assert v.phase == "running" and v.generation == 2 and v.ready_spares == []


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
    assert "ValueError: boom" in stop.message and v.phase == "stopped"


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
    assert isinstance(d.actions[0], Release) and v.phase == "finished"


def test_worker_failing_before_ready_stops_with_startup_message():
    v = ClusterView(world_size=2, total_steps=10, target_spares=1)
    d = feed(v, WorkerExited("w0", 2, "exited with code 2"))
    assert isinstance(d.actions[0], Stop) and "failed to start" in d.actions[0].message


def test_stale_generation_reports_are_ignored():
    v = running_view()
    feed(v, StepFailed("w0", 0, 0, 3))     # generation 0 never existed now
    assert v.phase == "running" and v.reports == {}


def test_plan_recovery_paths():
    assert plan_recovery({1}, {0: 5, 2: 5}, warm_spares=1).path == "memory"
    p = plan_recovery({1, 2}, {0: 5}, warm_spares=1)
    assert p.path == "wait" and p.start == 1
    assert plan_recovery({0, 1}, {}, 3, checkpoint_step=40).path == "checkpoint"
    assert plan_recovery({0, 1}, {}, 3).path == "stop"
