"""decide_shrink / decide_regrow: where an elastic job's virtual ranks run, read like the fault model."""
from hotspare.policy.shrink import decide_regrow, decide_shrink, held_by, physical_ranks, workers

FOUR = {0: "w0", 1: "w1", 2: "w2", 3: "w3"}


def test_a_lost_worker_with_no_spare_gives_its_virtual_rank_to_the_least_busy_survivor():
    s = decide_shrink(FOUR, ["w1"], elastic_min=2, spares_ready=0, spares_starting=0)
    assert s is not None and s.moved == {1: "w0"}
    assert s.holders == {0: "w0", 1: "w0", 2: "w2", 3: "w3"}
    assert workers(s.holders) == ["w0", "w2", "w3"] and physical_ranks(s.holders)["w3"] == 2
    assert "w1" in s.reason and "same global batch" in s.reason


def test_two_losses_spread_over_the_survivors():
    s = decide_shrink(FOUR, ["w0", "w2"], elastic_min=2, spares_ready=0, spares_starting=0)
    assert s.moved == {0: "w1", 2: "w3"}
    assert held_by(s.holders, "w1") == [0, 1] and workers(s.holders)[0] == "w1"   # runs virtual rank 0


def test_without_elastic_or_with_a_spare_there_is_no_shrink():
    assert decide_shrink(FOUR, ["w1"], elastic_min=None, spares_ready=0, spares_starting=0) is None
    assert decide_shrink(FOUR, ["w1"], elastic_min=2, spares_ready=1, spares_starting=0) is None
    assert decide_shrink(FOUR, ["w1"], elastic_min=2, spares_ready=0, spares_starting=1) is None


def test_never_below_the_minimum():
    assert decide_shrink(FOUR, ["w1", "w2"], elastic_min=3, spares_ready=0, spares_starting=0) is None
    assert decide_shrink(FOUR, ["w1"], elastic_min=3, spares_ready=0, spares_starting=0) is not None
    assert decide_shrink(FOUR, list(FOUR.values()), elastic_min=1, spares_ready=0, spares_starting=0) is None


def test_a_ready_spare_takes_the_busiest_workers_last_virtual_rank():
    shrunk = {0: "w0", 1: "w0", 2: "w2", 3: "w2", 4: "w2", 5: "w5"}
    r = decide_regrow(shrunk, ["s1", "s2"])
    assert (r.vrank, r.source, r.spare) == (4, "w2", "s1")
    assert held_by(r.holders, "s1") == [4] and held_by(r.holders, "w2") == [2, 3]


def test_regrow_after_shrink_puts_the_job_back_at_full_size():
    s = decide_shrink(FOUR, ["w1"], elastic_min=1, spares_ready=0, spares_starting=0)
    r = decide_regrow(s.holders, ["s"])
    assert r.vrank == 1 and r.source == "w0"
    assert decide_regrow(r.holders, ["t"]) is None                  # one virtual rank each again
    assert decide_regrow(s.holders, []) is None                     # no spare: stays shrunk
