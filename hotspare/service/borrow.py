"""Who gives a device to a job that lost a rank and has no spare left: a pure decision.

``decide_loans(wants, idle, holders, promised)`` reads the service's picture (the jobs short of
device slots, the idle hosts, the running jobs that could lend) and returns the loans to make,
who is left waiting, and why, in words. It changes nothing and does no I/O: the service
(``hotspare.service.lending``) carries the loans out, and the tests script the pictures.

The rules, in order:

1. Jobs short of slots are served highest priority first, then the one that waited longest.
2. Idle hosts of the pool go first (spare hosts before worker hosts): they cost nobody anything.
3. Otherwise a running job lends, if it is ``--preemptible`` and of **strictly lower** priority
   than the borrower: never an equal or higher one, never a non-preemptible one. Among those,
   a job already being paused goes first (its hosts are freed anyway), then the lowest
   priority, then the one started last (it loses the least work if its checkpoint failed).
   It lends only if it alone covers what the borrower lacks. An ``--elastic MIN`` lender
   that keeps at least MIN ranks without those hosts **shrinks** (its ranks there are
   released, their virtual ranks go to its survivors with the committed step's state from
   memory, and it keeps training); any other lender is paused whole (its state in a signed
   checkpoint, requeued, resumed when capacity returns).
4. A host is given once: a host promised to one borrower (``promised``, or earlier in the same
   decision) is never given to another. Two failures racing for the last borrowable host are
   served one each, or the second waits.

The borrower takes the fewest hosts that cover its need (largest first, then by name); a
borrowed host serves the borrower as a spare host: its warm spare path takes the lost rank.

``decide_returns(shrunk, idle)`` gives a lender that shrank its capacity back: idle hosts go to
the jobs running shrunk (highest priority first), each as a spare host on which the job grows
back (``policy.shrink.decide_regrow``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hotspare.service.priority import class_name


@dataclass(frozen=True)
class Want:
    """A running job short of ``slots`` device slots for ranks it lost (no spare, no free device).
    ``exclude``: hosts it may not be given, those it worked on already (a host it lost comes back
    to it only under another name: its coordinator refuses a lost node's name)."""
    job: str
    priority: int
    slots: int
    since: float
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Holder:
    """A running job and the hosts it works on, each with its usable device slots."""
    job: str
    priority: int
    preemptible: bool
    hosts: tuple[tuple[str, int], ...]
    started: float
    pausing: bool = False                # already being paused to lend (its hosts are being freed)
    elastic: int | None = None           # --elastic MIN, when it could shrink now (None: it cannot)
    ranks: tuple[tuple[str, int], ...] = ()   # host -> its live ranks there (an elastic job's)

    def can_shrink_off(self, hosts: tuple[str, ...]) -> bool:
        """Whether it keeps at least its --elastic minimum of ranks without ``hosts``."""
        if self.elastic is None:
            return False
        left = sum(n for h, n in self.ranks if h not in hosts)
        return left >= max(1, self.elastic) and left < sum(n for _, n in self.ranks)


@dataclass(frozen=True)
class Idle:
    """An idle host of the pool and its usable device slots."""
    host: str
    slots: int
    spare: bool


@dataclass(frozen=True)
class Loan:
    """``hosts`` (``slots`` slots) go to ``borrower``; ``lender``: the job paused to free them
    (None: they were idle in the pool); ``pause``: the lender must be told to pause now (it
    is not being paused already); ``shrink``: the lender is elastic and gives the hosts by
    shrinking (it is not paused)."""
    borrower: str
    borrower_priority: int
    lender: str | None
    lender_priority: int | None
    hosts: tuple[str, ...]
    slots: int
    pause: bool
    reason: str
    shrink: bool = False


@dataclass(frozen=True)
class Shrunk:
    """A running elastic job short of ``slots`` device slots to grow back to its size.
    ``exclude``: hosts it may not be given (those it worked on already)."""
    job: str
    priority: int
    slots: int
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True)
class LoanDecision:
    loans: tuple[Loan, ...]
    waiting: tuple[str, ...]                         # borrowers nothing could serve now
    reason: str
    why_waiting: dict[str, str] = field(default_factory=dict)


def _label(job: str, priority: int | None) -> str:
    return f"{job} ({class_name(priority) if priority is not None else '?'})"


def _cover(hosts: list[tuple[str, int]], need: int) -> list[tuple[str, int]] | None:
    """The fewest of ``hosts`` whose slots cover ``need`` (largest first, then by name)."""
    chosen, got = [], 0
    for host, slots in sorted(hosts, key=lambda h: (-h[1], h[0])):
        if got >= need:
            break
        if slots > 0:
            chosen.append((host, slots))
            got += slots
    return chosen if got >= need else None


def decide_loans(wants: list[Want], idle: list[Idle], holders: list[Holder],
                 promised: frozenset[str] = frozenset()) -> LoanDecision:
    taken = set(promised)
    paused_now: set[str] = set()
    shrunk_now: set[str] = set()
    loans: list[Loan] = []
    waiting: dict[str, str] = {}
    for want in sorted((w for w in wants if w.slots > 0), key=lambda w: (-w.priority, w.since, w.job)):
        who = _label(want.job, want.priority)
        if want.job in paused_now:
            waiting[want.job] = f"{who} is paused to lend its own devices: it waits in the queue instead"
            continue
        free = [(h.host, h.slots) for h in sorted(idle, key=lambda h: (not h.spare, h.host))
                if h.host not in taken and h.host not in want.exclude]
        pick = _cover(free, want.slots)
        if pick is not None:
            hosts = tuple(h for h, _ in pick)
            taken.update(hosts)
            loans.append(Loan(want.job, want.priority, None, None, hosts, sum(s for _, s in pick), False,
                              f"{who} is short of {want.slots} device slot(s): idle host(s) {', '.join(hosts)} "
                              "of the pool take the lost rank(s)"))
            continue
        refused: list[str] = []
        candidates = []
        for h in holders:
            if h.job == want.job:
                continue
            if not h.preemptible:
                refused.append(f"{h.job} is not preemptible")
                continue
            if h.priority >= want.priority:
                refused.append(f"{_label(h.job, h.priority)} is not of lower priority")
                continue
            if h.job in shrunk_now:
                refused.append(f"{h.job} is shrinking to lend already")
                continue
            left = [(host, slots) for host, slots in h.hosts if host not in taken]
            pick = _cover(left, want.slots)
            if pick is None:
                refused.append(f"{h.job} has {sum(s for _, s in left)} slot(s) left to lend, not {want.slots}")
                continue
            candidates.append((not (h.pausing or h.job in paused_now), h.priority, -h.started, h.job, h, pick))
        if not candidates:
            why = "; ".join(refused) or "no other job runs"
            waiting[want.job] = (f"{who} is short of {want.slots} device slot(s) and nothing can lend: no idle host, "
                                 f"{why}")
            continue
        *_, lender, pick = min(candidates, key=lambda c: c[:4])
        hosts = tuple(h for h, _ in pick)
        taken.update(hosts)
        already = lender.pausing or lender.job in paused_now
        # an elastic lender shrinks once per decision (its picture is stale after that)
        shrink = not already and lender.job not in shrunk_now and lender.can_shrink_off(hosts)
        (shrunk_now if shrink else paused_now).add(lender.job)
        order = ("already being paused" if already else
                 "the lowest priority below it" + (", started last" if len(candidates) > 1 else ""))
        left = sum(n for h, n in lender.ranks if h not in hosts)
        how = ("" if already else
               f"; it shrinks to {left} rank(s) (--elastic {lender.elastic}: its virtual ranks there go to its "
               "survivors, state of the committed step from memory) and keeps training" if shrink else
               "; it is paused (signed checkpoint, requeued, resumed when capacity returns)")
        loans.append(Loan(want.job, want.priority, lender.job, lender.priority, hosts, sum(s for _, s in pick),
                          not already and not shrink,
                          f"{who} is short of {want.slots} device slot(s) and no idle host is left: "
                          f"{_label(lender.job, lender.priority)}, preemptible, {order}, lends "
                          f"{', '.join(hosts)}{how}", shrink))
    reason = "; ".join([l.reason for l in loans] + list(waiting.values())) or "nobody is short of devices"
    return LoanDecision(tuple(loans), tuple(waiting), reason, waiting)


def decide_returns(shrunk: list[Shrunk], idle: list[Idle],
                   promised: frozenset[str] = frozenset()) -> list[tuple[str, tuple[str, ...]]]:
    """(job, hosts) for each job running shrunk that idle hosts (not promised, not one it worked
    on) can grow back: highest priority first, the fewest hosts that cover its slots, else as
    many as there are (each grows it back by what it holds)."""
    taken = set(promised)
    out = []
    for s in sorted((s for s in shrunk if s.slots > 0), key=lambda s: (-s.priority, s.job)):
        free = [(h.host, h.slots) for h in sorted(idle, key=lambda h: (not h.spare, h.host))
                if h.host not in taken and h.host not in s.exclude and h.slots > 0]
        pick = _cover(free, s.slots) or free
        if pick:
            hosts = tuple(h for h, _ in pick)
            taken.update(hosts)
            out.append((s.job, hosts))
    return out
