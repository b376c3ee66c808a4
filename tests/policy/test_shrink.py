"""decide_shrink / decide_regrow: where an elastic job's virtual ranks run, read like the fault model."""
from hotspare.policy.shrink import decide_regrow, decide_shrink, held_by, holders_of, layout, physical_ranks, workers

FOUR = {0: "w0", 1: "w1", 2: "w2", 3: "w3"}


def test_a_lost_worker_with_no_spare_gives_its_virtual_rank_to_the_least_busy_survivor():
    s = decide_shrink(FOUR, ["w1"], elastic_min=2, spares_ready=0)
    assert s is not None and s.moved == {1: "w0"}
    assert s.holders == {0: "w0", 1: "w0", 2: "w2", 3: "w3"}
    assert workers(s.holders) == ["w0", "w2", "w3"] and physical_ranks(s.holders)["w3"] == 2
    assert "w1" in s.reason and "same global batch" in s.reason


def test_two_losses_spread_over_the_survivors():
    s = decide_shrink(FOUR, ["w0", "w2"], elastic_min=2, spares_ready=0)
    assert s.moved == {0: "w1", 2: "w3"}
    assert held_by(s.holders, "w1") == [0, 1] and workers(s.holders)[0] == "w1"   # runs virtual rank 0


def test_without_elastic_or_with_a_spare_there_is_no_shrink():
    assert decide_shrink(FOUR, ["w1"], elastic_min=None, spares_ready=0) is None
    assert decide_shrink(FOUR, ["w1"], elastic_min=2, spares_ready=1) is None


def test_never_below_the_minimum():
    assert decide_shrink(FOUR, ["w1", "w2"], elastic_min=3, spares_ready=0) is None
    assert decide_shrink(FOUR, ["w1"], elastic_min=3, spares_ready=0) is not None
    assert decide_shrink(FOUR, list(FOUR.values()), elastic_min=1, spares_ready=0) is None


def test_a_ready_spare_takes_the_busiest_workers_last_virtual_rank():
    shrunk = {0: "w0", 1: "w0", 2: "w2", 3: "w2", 4: "w2", 5: "w5"}
    r = decide_regrow(shrunk, ["s1", "s2"])
    assert (r.vrank, r.source, r.spare) == (4, "w2", "s1")
    assert held_by(r.holders, "s1") == [4] and held_by(r.holders, "w2") == [2, 3]


def test_regrow_after_shrink_puts_the_job_back_at_full_size():
    s = decide_shrink(FOUR, ["w1"], elastic_min=1, spares_ready=0)
    r = decide_regrow(s.holders, ["s"])
    assert r.vrank == 1 and r.source == "w0"
    assert decide_regrow(r.holders, ["t"]) is None                  # one virtual rank each again
    assert decide_regrow(s.holders, []) is None                     # no spare: stays shrunk


def test_a_placement_is_a_generations_members():
    s = decide_shrink(FOUR, ["w0"], elastic_min=1, spares_ready=0)
    members, placement = layout(s.holders)
    assert members == {0: "w1", 1: "w2", 2: "w3"} and placement == (0, 0, 1, 2)
    assert holders_of(members, placement) == s.holders


# ---------------------------------------------------------------- through decide(), signal by signal
from hotspare.policy.decide import (ClusterView, FormGeneration, Paused, Regrow, StartSpares, StepFailed,  # noqa: E402
                                    WorkerExited, WorkerReady)
from hotspare.policy.phase import JobPhase  # noqa: E402
from hotspare.testing.decisions import feed  # noqa: E402


def elastic_view(world=3, elastic=1):
    v = ClusterView(world_size=world, target_spares=0, elastic_min=elastic,
                    placement=None if elastic is None else tuple(range(world)))
    for r in range(world):
        feed(v, WorkerReady(f"w{r}", "active", r))
    assert v.phase is JobPhase.RUNNING
    return v


def test_kill_with_no_spare_shrinks_at_once_and_a_replacement_still_starts():
    v = elastic_view()
    feed(v, WorkerExited("w1", -9, "was killed by SIGKILL"))
    feed(v, StepFailed("w0", 0, 1, 29))
    d = feed(v, StepFailed("w2", 2, 1, 29))
    form, start = d.actions
    assert isinstance(form, FormGeneration) and isinstance(start, StartSpares) and start.count == 1
    assert form.members == {0: "w0", 1: "w2"} and form.placement == (0, 0, 1) and form.before == (0, 1, 2)
    assert form.target == 29 and form.source == 0 and form.receivers == () and not form.replacements
    assert "shrinking to 2" in d.reason and v.placement == (0, 0, 1) and v.phase is JobPhase.RUNNING


def test_a_laggard_survivor_is_a_receiver_under_its_new_rank():
    v = elastic_view()
    feed(v, WorkerExited("w0", -9))
    feed(v, StepFailed("w1", 1, 1, 29))
    (form, _) = feed(v, StepFailed("w2", 2, 1, 30)).actions
    assert form.members == {0: "w1", 1: "w2"} and form.placement == (0, 0, 1)
    assert form.source == 1 and form.receivers == (0,) and form.target == 30


def test_the_spare_that_becomes_ready_takes_its_virtual_rank_back_at_a_step_boundary():
    v = elastic_view()
    feed(v, WorkerExited("w1", -9))
    feed(v, StepFailed("w0", 0, 1, 29))
    feed(v, StepFailed("w2", 2, 1, 29))
    (regrow,) = feed(v, WorkerReady("s0", "spare")).actions
    assert isinstance(regrow, Regrow) and (regrow.vrank, regrow.spare) == (1, "s0")
    assert v.phase is JobPhase.RECOVERING and v.regrowing == regrow
    assert feed(v, Paused("w0", 0, 2, 41)).actions == ()
    (form,) = feed(v, Paused("w2", 1, 2, 41)).actions
    assert form.regrow and form.members == {0: "w0", 1: "s0", 2: "w2"} and form.placement == (0, 1, 2)
    assert form.before == (0, 0, 1) and form.source == 0 and form.receivers == (1,) and form.target == 41
    assert v.phase is JobPhase.RUNNING and v.regrowing is None and v.reforms.get(42, 0) == 0
    assert feed(v, WorkerReady("s1", "spare")).actions == ()          # full size: nothing to regrow


def test_not_elastic_or_at_the_minimum_waits_for_capacity_as_before():
    for v in (elastic_view(elastic=None), elastic_view(elastic=3)):
        feed(v, WorkerExited("w1", -9))
        feed(v, StepFailed("w0", 0, 1, 29))
        d = feed(v, StepFailed("w2", 2, 1, 29))
        assert d.actions == (StartSpares(1),) and v.phase is JobPhase.RECOVERING and v.generation == 1
