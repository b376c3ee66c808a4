"""An elastic lender gives a host by shrinking, not pausing (pure: no processes, no sockets).
The fault model: a production job loses a rank while an elastic best-effort job fills the rest
of the pool. Above its --elastic minimum the lender shrinks (its ranks on the lent host go, its
virtual ranks to its survivors) and keeps training; at its minimum, or while it cannot shrink
now (recovering, growing back), it is paused as any lender; without --elastic nothing changes.
The host it lent leaves it at once (releasing, never placed on by it again), and idle hosts go
back to a job running shrunk so that it grows back."""
from hotspare.policy.phase import JobPhase
from hotspare.policy.view import ClusterView
from hotspare.service import hostlife as life
from hotspare.service.borrow import Holder, Idle, Shrunk, Want, decide_loans, decide_returns
from hotspare.service.hostlife import HostPhase, HostState, transition
from hotspare.service.pause import regrow_slots, shrink_ranks
from hotspare.service.priority import CLASSES

PROD, BEST = CLASSES["production"], CLASSES["best-effort"]


def elastic(job, minimum, ranks, priority=BEST):
    return Holder(job, priority, True, tuple((h, 1) for h, _ in ranks), 0.0, False, minimum, tuple(ranks))


def test_an_elastic_lender_above_its_minimum_shrinks_instead_of_pausing():
    (loan,) = decide_loans([Want("j1", PROD, 1, 0.0)], [], [elastic("j2", 1, [("c", 1), ("d", 1)])]).loans
    assert (loan.lender, loan.hosts, loan.shrink, loan.pause) == ("j2", ("c",), True, False)
    assert "it shrinks to 1 rank(s) (--elastic 1" in loan.reason and "paused" not in loan.reason


def test_an_elastic_lender_at_its_minimum_or_unable_to_shrink_now_is_paused_as_any():
    for holder in (elastic("j2", 2, [("c", 1), ("d", 1)]),            # would fall below its minimum
                   elastic("j2", 1, [("c", 1)]),                       # its only host: nothing would be left
                   elastic("j2", None, [("c", 1), ("d", 1)]),          # recovering or growing back now
                   Holder("j2", BEST, True, (("c", 1), ("d", 1)), 0.0)):  # not elastic
        (loan,) = decide_loans([Want("j1", PROD, 1, 0.0)], [], [holder]).loans
        assert loan.pause and not loan.shrink and "it is paused" in loan.reason, holder


def test_an_elastic_lender_shrinks_once_per_decision_and_a_second_borrower_waits():
    wants = [Want("j1", PROD, 1, 0.0), Want("j3", PROD, 1, 1.0)]
    d = decide_loans(wants, [], [elastic("j2", 1, [("c", 1), ("d", 1), ("e", 1)])])
    assert [(l.borrower, l.hosts, l.shrink) for l in d.loans] == [("j1", ("c",), True)]
    assert d.waiting == ("j3",) and "j2 is shrinking to lend already" in d.why_waiting["j3"]


def test_a_host_lent_by_shrinking_is_released_by_its_agent_then_idle_for_the_borrower():
    busy = HostState(HostPhase.BUSY, "j2")
    lent, why = transition(busy, life.Lent("j2"), 1.0)
    assert lent.phase is HostPhase.RELEASING and lent.job == "j2" and "shrinks to lend it" in why
    assert transition(lent, life.Released("j2"), 2.0)[0].phase is HostPhase.IDLE
    assert transition(busy, life.Lent("j9"), 1.0)[0] == busy                  # another job's word: nothing
    assert transition(HostState(HostPhase.IDLE), life.Lent("j2"), 1.0)[0].phase is HostPhase.IDLE


def view_of(members, placement, phase=JobPhase.RUNNING):
    v = ClusterView(world_size=len(placement), target_spares=0)
    v.phase, v.members, v.placement = phase, dict(members), tuple(placement)
    return v


def test_what_the_decision_reads_of_a_running_elastic_job():
    node = {"w0": "c", "w1": "d"}.__getitem__
    full = view_of({0: "w0", 1: "w1"}, (0, 1))
    assert shrink_ranks(full, 1, node) == (1, (("c", 1), ("d", 1)))
    assert shrink_ranks(full, None, node) == (None, ())                        # not elastic
    assert shrink_ranks(view_of({0: "w0", 1: "w1"}, (0, 1), JobPhase.RECOVERING), 1, node) == (None, ())
    lost = view_of({0: "w0", 1: "w1"}, (0, 1))
    lost.lost = {1}
    assert shrink_ranks(lost, 1, node) == (None, ())
    assert regrow_slots(full, 1) == 0                                         # not shrunk
    shrunk = view_of({0: "w0"}, (0, 0))
    assert regrow_slots(shrunk, 1) == 1 and regrow_slots(shrunk, 0) == 0      # no spare waits: nothing to give
    assert regrow_slots(shrunk, 1, coming=1) == 0                             # a host given back is on its way


def test_idle_hosts_go_back_to_the_job_running_shrunk_never_a_host_it_worked_on():
    shrunk = [Shrunk("j2", BEST, 1, frozenset({"c", "d"})), Shrunk("j4", PROD, 1), Shrunk("j5", BEST, 0)]
    idle = [Idle("d", 1, False), Idle("b", 1, False), Idle("e", 1, False)]
    assert decide_returns(shrunk, idle) == [("j4", ("b",)), ("j2", ("e",))]
    # promised hosts are never given; j2 may not have d back under its old name, j4 may
    assert decide_returns(shrunk, idle, promised=frozenset({"b", "e"})) == [("j4", ("d",))]
    assert decide_returns(shrunk[:1], idle, promised=frozenset({"b", "e"})) == []
