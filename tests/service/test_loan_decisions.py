"""Who lends a device to a job that lost a rank with no spare left (pure: no processes, no
sockets). The fault model: a production job loses a rank while best-effort and research jobs
fill the pool. It borrows only from strictly lower, preemptible work; idle hosts go first; two
failures racing for the last borrowable host get one each, or the second waits; a host is never
given twice."""
from hotspare.service.borrow import Holder, Idle, Want, decide_loans
from hotspare.service.priority import CLASSES

PROD, RESEARCH, BEST = CLASSES["production"], CLASSES["research"], CLASSES["best-effort"]


def holder(job, priority, preemptible=True, hosts=(("h", 1),), started=0.0, pausing=False):
    return Holder(job, priority, preemptible, tuple(hosts), started, pausing)


def test_a_production_job_short_of_a_slot_borrows_from_the_best_effort_job_which_is_paused():
    d = decide_loans([Want("j1", PROD, 1, 10.0)], [], [holder("j1", PROD, False, [("a", 1), ("b", 1)]),
                                                       holder("j2", BEST, True, [("c", 2)])])
    (loan,) = d.loans
    assert (loan.borrower, loan.lender, loan.hosts, loan.slots, loan.pause) == ("j1", "j2", ("c",), 2, True)
    assert d.waiting == () and "j2 (best-effort), preemptible" in loan.reason and "paused" in loan.reason


def test_idle_hosts_go_first_spare_hosts_before_worker_hosts_and_nobody_is_paused():
    d = decide_loans([Want("j1", PROD, 1, 0.0)], [Idle("w", 1, False), Idle("s", 1, True)],
                     [holder("j2", BEST)])
    (loan,) = d.loans
    assert loan.lender is None and loan.hosts == ("s",) and not loan.pause


def test_never_from_equal_or_higher_priority_nor_from_a_non_preemptible_job():
    holders = [holder("same", PROD, True, [("a", 4)]), holder("higher", PROD + 1, True, [("b", 4)]),
               holder("pinned", BEST, False, [("c", 4)])]
    d = decide_loans([Want("j1", PROD, 1, 0.0)], [], holders)
    assert d.loans == () and d.waiting == ("j1",)
    why = d.why_waiting["j1"]
    assert "same (production) is not of lower priority" in why and "higher" in why
    assert "pinned is not preemptible" in why


def test_a_best_effort_job_never_borrows_from_anyone_above_it():
    d = decide_loans([Want("low", BEST, 1, 0.0)], [], [holder("high", PROD, True, [("a", 2)])])
    assert d.loans == () and d.waiting == ("low",)


def test_the_lowest_priority_lends_first_then_the_one_started_last():
    holders = [holder("research", RESEARCH, True, [("a", 1)], started=5.0),
               holder("old", BEST, True, [("b", 1)], started=1.0),
               holder("new", BEST, True, [("c", 1)], started=9.0)]
    (loan,) = decide_loans([Want("j1", PROD, 1, 0.0)], [], holders).loans
    assert loan.lender == "new" and "started last" in loan.reason


def test_a_lender_must_cover_the_whole_need_alone_with_its_fewest_hosts():
    holders = [holder("small", BEST, True, [("a", 1)], started=9.0),
               holder("big", BEST, True, [("b", 1), ("c", 2), ("d", 2)], started=1.0)]
    (loan,) = decide_loans([Want("j1", PROD, 2, 0.0)], [], holders).loans
    assert loan.lender == "big" and loan.hosts == ("c",) and loan.slots == 2


def test_two_failures_racing_for_the_last_borrowable_host_one_is_served_the_other_waits():
    holders = [holder("low", BEST, True, [("c", 1)])]
    wants = [Want("j1", PROD, 1, 2.0), Want("j3", PROD, 1, 1.0)]
    d = decide_loans(wants, [], holders)
    (loan,) = d.loans
    assert loan.borrower == "j3" and loan.hosts == ("c",)          # the one that waited longer
    assert d.waiting == ("j1",) and "low has 0 slot(s) left to lend" in d.why_waiting["j1"]
    # and decided again with that host promised: still never given twice
    again = decide_loans([Want("j1", PROD, 1, 2.0)], [], holders, promised=frozenset({"c"}))
    assert again.loans == () and again.waiting == ("j1",)


def test_two_failures_and_two_hosts_of_one_lender_one_each_and_the_lender_is_paused_once():
    holders = [holder("low", BEST, True, [("c", 1), ("d", 1)])]
    d = decide_loans([Want("j1", PROD, 1, 0.0), Want("j3", RESEARCH, 1, 0.0)], [], holders)
    assert [(l.borrower, l.hosts, l.pause) for l in d.loans] == [("j1", ("c",), True), ("j3", ("d",), False)]
    assert len({h for l in d.loans for h in l.hosts}) == 2


def test_a_job_already_being_paused_lends_before_a_new_victim_is_paused():
    holders = [holder("pausing", RESEARCH, True, [("d", 1)], pausing=True),
               holder("other", BEST, True, [("e", 1)])]
    (loan,) = decide_loans([Want("j1", PROD, 1, 0.0)], [], holders, promised=frozenset({"c"})).loans
    assert loan.lender == "pausing" and not loan.pause and "already being paused" in loan.reason


def test_the_higher_priority_want_is_served_first_and_a_lender_never_also_borrows():
    holders = [holder("mid", RESEARCH, True, [("b", 1)]), holder("low", BEST, True, [("c", 1)])]
    wants = [Want("mid", RESEARCH, 1, 0.0), Want("top", PROD, 1, 5.0)]
    d = decide_loans(wants, [], holders)
    # top takes low's host (the lowest first); low has nothing left for mid, which waits
    assert [(l.borrower, l.lender) for l in d.loans] == [("top", "low")]
    assert d.waiting == ("mid",)
    # had mid been chosen as the lender, its own want would be dropped, never served
    d2 = decide_loans([Want("top", PROD, 1, 0.0), Want("mid", RESEARCH, 1, 0.0)], [],
                      [holder("mid", RESEARCH, True, [("b", 1)])])
    assert [(l.borrower, l.lender) for l in d2.loans] == [("top", "mid")] and d2.waiting == ("mid",)
    assert "paused to lend its own devices" in d2.why_waiting["mid"]


def test_nobody_short_nothing_to_do():
    d = decide_loans([Want("j1", PROD, 0, 0.0)], [Idle("a", 1, True)], [])
    assert d.loans == () and d.waiting == () and d.reason == "nobody is short of devices"


def test_a_host_the_job_worked_on_is_never_lent_back_to_it_under_its_old_name():
    d = decide_loans([Want("j1", PROD, 1, 0.0, frozenset({"a", "b"}))], [Idle("b", 1, False)], [])
    assert d.loans == () and d.waiting == ("j1",)
    (loan,) = decide_loans([Want("j1", PROD, 1, 0.0, frozenset({"a", "b"}))], [Idle("b2", 1, False)], []).loans
    assert loan.hosts == ("b2",)
