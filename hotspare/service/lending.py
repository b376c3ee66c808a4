"""The service's side of borrowed devices: it gathers who is short and who could lend, asks the
pure decision (``hotspare.service.borrow``), and carries the loans out (mixed into ``Service``,
whose hosts, runners, lock and database it uses; it runs on the service's thread).

A job that lost a rank and cannot place its replacement says how many device slots it lacks
(``ShortOf``, from its runner's thread). A loan from idle hosts is assigned at once, as a spare
host of the borrower, whose executor starts the spare that waited there and recovers the rank
from a survivor's memory as with any spare. A loan from a running job pauses that job
(``JobRunner.pause``: a signed checkpoint, then it is queued again) and *promises* the hosts to
the borrower; when the lender's agents have released them (``hostlife``: idle again), they go
to the borrower before anything else is placed (``_honour_loans``). An elastic lender above its
minimum is not paused: it *shrinks* (``JobRunner.shrink_off``): the host leaves it (``Lent``:
releasing, so its cold replacement can never start there), its agent ends the job's workers
there, and the job goes on with its virtual ranks on the survivors, state of the committed
step from memory (``policy.shrink``); once the agent said ``released`` the host is the
borrower's as above. A job running shrunk is given idle hosts back as spare hosts
(``_give_back``, ``borrow.decide_returns``), on which it grows back (``Regrow``). A promised host is never
decided on again, so one host is never given to two jobs. Both jobs get the one
``DeviceLoaned`` event (their logs, event streams and reports); the database's log says it too.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from hotspare.coordinator import events as ev
from hotspare.service.borrow import Holder, Idle, Loan, Shrunk, Want, decide_loans, decide_returns
from hotspare.service import hostlife as life
from hotspare.service.hostlife import HostPhase


@dataclass(frozen=True)
class ShortOf:
    """Job ``job`` lacks ``slots`` device slots for ranks it lost (0: no longer), having taken in
    the first ``seen`` hosts the service assigned it (one given since is on its way)."""
    job: str
    slots: int
    seen: int
    t: float


class Lending:
    """(Mixed into ``Service``.) ``_wants``: job -> (slots it lacks, since when, hosts it had
    seen); ``_promised``: host -> the loan it is promised to, until its lender released it."""

    def _lending_init(self) -> None:
        self._wants: dict[str, tuple[int, float, int]] = {}
        self._promised: dict[str, tuple[Loan, ev.DeviceLoaned]] = {}
        self._said_waiting: dict[str, str] = {}

    def _short(self, e: ShortOf) -> None:
        with self._lock:
            if e.slots <= 0:
                self._wants.pop(e.job, None)
                self._said_waiting.pop(e.job, None)
                return
            since = self._wants.get(e.job, (0, e.t, 0))[1]
            self._wants[e.job] = (e.slots, since, e.seen)
            self.log(f"[{e.job}] CAPACITY short of {e.slots} device slot(s) for lost rank(s), no spare left")
        self._lend()

    def _picture(self) -> tuple[list[Want], list[Idle], list[Holder]]:
        """(Under the lock.) What the decision reads: the jobs short of slots (less what is
        promised to them, and what was assigned after their report), the idle hosts, the
        running jobs and their hosts."""
        wants, holders = [], []
        for job, (slots, since, seen) in self._wants.items():
            r = self.runners.get(job)
            if r is not None and r.pausing is None:
                given = sum(self._slots(h) for h, (loan, _) in self._promised.items() if loan.borrower == job)
                given += sum(r.spare_hosts.get(h, 0) for h in r.nodes[seen:])
                wants.append(Want(job, r.policy.priority, slots - given, since, frozenset(r.nodes)))
        for job, r in self.runners.items():
            hosts = tuple((n, self._slots(n)) for n in r.nodes if n in self.hosts
                          and (self.hosts[n].state.phase, self.hosts[n].state.job) == (HostPhase.BUSY, job))
            holders.append(Holder(job, r.policy.priority, r.policy.preemptible, hosts, r.started_at,
                                  r.pausing is not None, *r.shrinkable()))
        idle = [Idle(h.name, len(h.devices), h.spare) for h in self.free_hosts() if h.devices]
        return wants, idle, holders

    def _slots(self, host: str) -> int:
        return len(self.in_service(self.hosts[host].pool_view()).devices)

    def _lend(self) -> None:
        """Decide on every job short of slots now, and carry the loans out."""
        now = time.time()
        with self._lock:
            if not self._wants:
                return
            wants, idle, holders = self._picture()
            decision = decide_loans(wants, idle, holders, frozenset(self._promised))
            for loan in decision.loans:
                self._carry_out(loan, now)
            for job, why in decision.why_waiting.items():
                if self._said_waiting.get(job) != why:
                    self._said_waiting[job] = why
                    self.log(f"[{job}] LOAN    waiting: {why}")

    def _carry_out(self, loan: Loan, now: float) -> None:
        """(Under the lock.) One loan: the event to both jobs, then the hosts or the pause."""
        gives = "" if loan.lender is None else "shrink" if loan.shrink else "pause"
        event = ev.DeviceLoaned(loan.borrower, loan.lender or "", loan.hosts, loan.slots, loan.borrower_priority,
                                loan.lender_priority, loan.reason, now, gives)
        borrower = self.runners[loan.borrower]
        self.log(f"[{loan.borrower}] LOAN    {loan.reason}")
        self.db.event(f"borrows {', '.join(loan.hosts)} from {loan.lender or 'the idle pool'}: {loan.reason}",
                      loan.borrower)
        borrower.note_loan(event)
        if loan.lender is None:
            self._assign(borrower, list(loan.hosts), spare_host=True)
            return
        for host in loan.hosts:
            self._promised[host] = (loan, event)
        self.db.event(f"lends {', '.join(loan.hosts)} to {loan.borrower}: {loan.reason}", loan.lender)
        lender = self.runners[loan.lender]
        if loan.shrink:
            for host in loan.hosts:        # releasing: no longer the lender's to place on, nor routed to it
                self._apply(host, life.Lent(loan.lender))
            lender.shrink_off(event, {host: self.hosts[host].channel for host in loan.hosts})
        elif loan.pause:
            lender.pause(event)
        else:
            lender.note_loan(event)

    def _honour_loans(self) -> None:
        """(Under the lock.) Promised hosts their lender released go to their borrower now; a
        promise whose host left, or whose borrower ended, is dropped (the host, if idle, is the
        pool's again)."""
        dropped = False
        for host, (loan, event) in list(self._promised.items()):
            h = self.hosts.get(host)
            borrower = self.runners.get(loan.borrower)
            if h is None or h.state.phase is HostPhase.GONE or borrower is None or borrower.coord.view.phase.over:
                del self._promised[host]
                dropped = True
                continue
            if h.state.phase is not HostPhase.IDLE:
                continue
            del self._promised[host]
            self.log(f"[{loan.borrower}] LOAN    {host}, released by {loan.lender}, now takes the lost rank "
                     f"({event.t and time.time() - event.t:.2f} s after the decision)")
            self._assign(borrower, [host], spare_host=True)
        if dropped and self._wants:
            self._lend()

    def _give_back(self) -> None:
        """(Under the lock.) Idle hosts go to the jobs running shrunk, as spare hosts: each grows
        back on the spare its executor starts there (``Regrow`` at a step boundary)."""
        shrunk = [Shrunk(job, r.policy.priority, r.regrow_slots(), frozenset(r.nodes))
                  for job, r in self.runners.items() if r.pausing is None]
        idle = [Idle(h.name, len(h.devices), h.spare) for h in self.free_hosts() if h.devices]
        for job, hosts in decide_returns(shrunk, idle, frozenset(self._promised)):
            runner = self.runners[job]
            self.log(f"[{job}] LOAN    {', '.join(hosts)} idle again: it runs shrunk, so it grows back there")
            self.db.event(f"grows back on {', '.join(hosts)}", job)
            runner.returned.update(hosts)
            self._assign(runner, list(hosts), spare_host=True)
