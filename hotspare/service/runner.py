"""One job of the coordinator service, driven by a thread of its own.

A ``JobRunner`` builds the job the way ``hotspare run`` does (``hotspare.service.build``: the
typed configuration, the worker contract, the ledger, the view and the ``Coordinator``) and
runs its event loop. The job's state (``hotspare.coordinator.persist``) goes to the database
each time its membership changes, and at least every ``SAVE_EVERY_S`` while it trains, so a
restarted service resumes it (``resume``): it waits a lease and a margin for the job's node
agents to re-register, takes in what they replay, declares the nodes that did not come back
lost (their ranks fail over as usual), then carries on.

A job that loses a rank with no device to replace it says so (``short``, ``pause.short_of``);
the service may then give it a host borrowed from a lower-priority preemptible job, which it
``pause``s: that job stops after a signed checkpoint and is queued again to resume from it
(``pause``). Both jobs' reports hold the loan (``loans``); a paused job's report also holds
each pause (``pauses``).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

from hotspare.config import RunConfig
from hotspare.coordinator import events as ev
from hotspare.coordinator import persist
from hotspare.errors import ConfigError
from hotspare.protocol.messages import make
from hotspare.service import db as states
from hotspare.service.db import StateDB
from hotspare.service.pause import pause_record, regrow_slots, resume_request, short_of, shrink_ranks
from hotspare.service.priority import JobPolicy

SAVE_EVERY_S = 1.0
START_TIMEOUT_S = 60.0
FINISH_CHECKS_S = 30.0    # a job's end waits this long at most for the device checks running on its hosts
REJOIN_SLACK_S = 1.0      # beyond lease + margin, for the agents' reconnection attempts


class JobRunner:
    def __init__(self, job: str, cfg: RunConfig, db: StateDB, store: dict[str, Any], lease: float, margin: float,
                 log: Callable[[str], None], on_end: Callable[["JobRunner"], None], registry=None, observe=None,
                 policy: JobPolicy = JobPolicy(), request: dict[str, Any] | None = None,
                 short: Callable[[str, int, int], None] | None = None, pauses: tuple[dict[str, Any], ...] = ()):
        """``registry``: the service's device registry (``hotspare.health.registry``, in its
        database); the job's health desk watches its hosts' devices there, unless the job's
        --telemetry is off (or no registry is given). ``policy``: its priority and preemption;
        ``request``: what was submitted (a paused job is queued again with it); ``short(job,
        slots, seen)``: called from its thread each time the device slots it lacks for lost
        ranks change (``seen``: the hosts it has taken in); ``pauses``: the pauses of its earlier runs (for its report)."""
        from hotspare.service.build import control_plane, health_desk
        from hotspare.service.checks import service_preflight
        self.job, self.cfg, self.db, self.store = job, cfg, db, store
        self.lease, self.margin = lease, margin
        self.events: "queue.Queue" = queue.Queue()
        self.log = lambda line: log(f"[{job}] {line}")
        self._on_end = on_end
        self.pre = service_preflight(cfg)
        watched = registry is not None and cfg.health.telemetry != "off"
        self.health = health_desk(cfg, self.pre, registry, self.log, adopt=True) if watched else None
        # how often its hosts' agents poll their devices and send the readings (0: not at all)
        self.telemetry_period = cfg.health.telemetry_period if watched else 0.0
        self.ledger, self.coord = control_plane(cfg, self.pre, self.events, self.health, self.log, job=job)
        # hotspare coordinator --metrics / --dashboard (hotspare.observe.service): told the job's end
        self.observer = observe(job, self.coord, self.ledger, self.health) if observe is not None else None
        self.coord.command("cancel", self._cancel)
        self.coord.command("pause", self._pause)
        self.coord.listen(ev.DeviceLoaned, self._loaned)
        self.policy, self.request, self._short, self.pauses = policy, request, short, list(pauses)
        self.loans: list[dict[str, Any]] = []      # the DeviceLoaned records of this job (both sides)
        self.pausing: ev.DeviceLoaned | None = None   # set once the service paused it to lend its devices
        self._pause_asked_at = 0.0
        self._said_short = 0
        self.started_at = time.time()
        self.coord.journal = lambda: self._save(force=True)
        self.nodes: list[str] = []          # where it was placed, in placement order
        self._saved_key: Any = None
        self._saved_at = 0.0
        self.code: int | None = None
        self.cancelled = False
        self.cancelled_by = ""
        self._cancel_lock = threading.Lock()
        self._started = False                  # coord.start (or the rejoin) returned: commands reach it
        self._cancel_pending = ""              # cancelled before that, by whom
        self.spare_hosts: dict[str, int] = {}   # host -> the spare slots it holds for this job (0: a rank host)
        self.returned: set[str] = set()          # hosts given back to it while it ran shrunk (lending.py)
        self.worker_env = self._worker_env(int(cfg.launch.nproc // max(1, cfg.hosts.remote_nodes)))

    def _worker_env(self, per_node: int) -> dict[str, str]:
        """What every worker of this job gets, on whichever host: torchrun's variables, the
        rendezvous store, and the job's part of the worker contract."""
        from hotspare.checkpoint.auth import ENV_KEY
        from hotspare.service.build import job_env
        world = str(self.cfg.launch.nproc)
        return {"WORLD_SIZE": world, "LOCAL_WORLD_SIZE": str(per_node), "ROLE_WORLD_SIZE": world,
                "GROUP_WORLD_SIZE": "1", "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": self.job,
                "MASTER_ADDR": str(self.store["host"]), "MASTER_PORT": str(self.store["port"]),
                "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", ENV_KEY: self.pre.key_file,
                **job_env(self.cfg, self.pre).to_env()}

    def spare_slots(self) -> int:
        return sum(self.spare_hosts.values())

    # ------------------------------------------------------------------ life
    def start(self, nodes: list[str], resume: dict[str, Any] | None = None) -> None:
        self.nodes = list(nodes)
        self.started_at = time.time()
        threading.Thread(target=self._run, args=(resume,), name=f"job-{self.job}", daemon=True).start()

    def cancel(self, origin: str) -> None:
        """From any thread: the job stops as soon as its thread sees it, after a last checkpoint
        (a job still starting stops once its ranks are started, none of them left behind)."""
        with self._cancel_lock:
            if not self._started:
                self._cancel_pending = self._cancel_pending or origin
                return
        self.events.put(ev.OperatorCommand({"type": "cancel"}, origin, lambda reply: None, time.time()))

    def pause(self, loan: ev.DeviceLoaned) -> None:
        """From the service's thread: this job lends its hosts (``loan``); it stops after a signed
        checkpoint as on a cancel, and is queued again to resume from it (``_run``'s end)."""
        self.note_loan(loan)
        with self._cancel_lock:
            self.pausing, self._pause_asked_at = loan, time.time()
            if not self._started:
                self._cancel_pending = self._cancel_pending or f"the service (lending to {loan.borrower})"
                return
        self.events.put(ev.OperatorCommand({"type": "pause"}, "the service", lambda reply: None, time.time()))

    def shrinkable(self) -> tuple[int | None, tuple[tuple[str, int], ...]]:
        """(From the service's thread.) Its --elastic minimum and live ranks per host, when it
        could shrink to lend a host now (``pause.shrink_ranks``)."""
        if self.pausing is not None:
            return None, ()
        return shrink_ranks(self.coord.view, self.cfg.capacity.elastic, lambda w: self.coord.nodes.workers[w].node)

    def regrow_slots(self) -> int:
        """(From the service's thread.) Device slots it lacks to grow back (``pause.regrow_slots``);
        a host given back that none of its workers runs on yet is still coming."""
        if not self.cfg.capacity.elastic:
            return 0
        used = {w.node for w in list(self.coord.nodes.workers.values())}
        coming = sum(n for h, n in list(self.spare_hosts.items()) if h in self.returned and h not in used)
        return regrow_slots(self.coord.view, self.coord.executor.unplaced, coming)

    def shrink_off(self, loan: ev.DeviceLoaned, channels: dict[str, Any]) -> None:
        """From the service's thread: this elastic job lends ``loan.hosts`` by shrinking. Its
        coordinator takes each host as lost first (its ranks there are lost with it, and no
        replacement is ever placed there), then the host's agent ends the job's workers there;
        the job shrinks through ``policy.shrink`` (virtual ranks to the survivors, state of the
        committed step from their memory, every byte kept) and keeps training."""
        self.note_loan(loan)
        self.log(f"LEND    {', '.join(loan.hosts)} to {loan.borrower}: shrinking (--elastic "
                 f"{self.cfg.capacity.elastic}) instead of pausing; its ranks there are released")
        for host, channel in channels.items():
            self.events.put(ev.NodeLost(host, channel, time.time()))
            try:
                channel.send(make("shutdown", grace=0.0))
            except (OSError, AttributeError):
                pass                       # its link closed: the job sees it lost all the same

    def note_loan(self, loan: ev.DeviceLoaned) -> None:
        """From the service's thread: the loan goes into this job's report, and to its event
        queue (its log line, the event stream of an observed job)."""
        self.loans.append(ev.to_record(loan))
        self.events.put(loan)

    def _loaned(self, loan: ev.DeviceLoaned) -> None:
        side = "borrows" if loan.borrower == self.job else "lends"
        self.log(f"LOAN    {side} {', '.join(loan.hosts)} ({loan.slots} slot(s)): {loan.reason}")

    def _pause(self, msg, origin: str):
        """Every rank leaves its step and the lowest survivor writes a last checkpoint, as on
        SIGTERM (``coordinator.preempt``); the job then stops and ``_run`` queues it again."""
        loan = self.pausing
        if loan is not None and not self.coord.preemption.active:
            self.log(f"PAUSE   lending {', '.join(loan.hosts)} to {loan.borrower}: stopping after a signed "
                     "checkpoint; queued again to resume from it")
            self.coord.handle(ev.Preempt(f"paused to lend to {loan.borrower}", 143, time.time()))
        return make("control_reply", ok=True, message=f"job {self.job} pausing")

    def _say_short(self) -> None:
        """Tell the service when the device slots this job lacks for lost ranks change."""
        n = short_of(self.coord.view, self.coord.executor.unplaced) if self.pausing is None else 0
        if n != self._said_short and self._short is not None:
            self._said_short = n
            self._short(self.job, n, len(self.coord.nodes.nodes))

    def _cancel(self, msg, origin: str):
        """Every rank leaves its step and the lowest survivor writes a last checkpoint to the job's
        checkpoint directory, as on SIGTERM to `hotspare run` (``coordinator.preempt``); a job
        with no rank holding state yet just stops."""
        if not self.cancelled:
            self.cancelled, self.cancelled_by = True, origin
            self.log(f"CANCEL  by {origin}: stopping after a last checkpoint")
            self.coord.handle(ev.Preempt("SIGTERM", 143, time.time()))
        return make("control_reply", ok=True, message=f"job {self.job} cancelled")

    def _run(self, resume: dict[str, Any] | None) -> None:
        coord = self.coord
        state, message = states.STOPPED, ""
        try:
            if resume is None:
                coord.start(nodes=len(self.nodes), timeout=START_TIMEOUT_S)
            else:
                self._rejoin(resume)
            with self._cancel_lock:
                self._started, pending = True, self._cancel_pending
            if pending and self.pausing is not None and not self.cancelled:
                self._pause(None, pending)
            elif pending:
                self._cancel(None, pending)
            while not coord.over():
                coord.step()
                self._save()
                self._say_short()
            code = coord.exit_code if coord.exit_code is not None else 1
            if self.ledger.outcome == "finished":
                state = states.FINISHED
            message = self.ledger.message
        except ConfigError as e:
            code, message = 2, str(e)
            self.log(f"job could not start: {e}")
        except Exception as e:                 # one job's failure must not end the service
            code, message = 1, f"{type(e).__name__}: {e}"
            self.log(f"job failed in the coordinator: {message}")
        by = self.cancelled_by or self._cancel_pending
        if by and state != states.FINISHED:
            state, message = states.CANCELLED, f"cancelled by {by}" + (f": {message}" if message else "")
        paused = self.pausing is not None and state != states.FINISHED and not self.cancelled
        # Device checks still running on its hosts finish first (a device that passes goes back
        # to the pool), unless the job was cancelled or paused (its hosts are wanted now).
        coord.finish_checks(0.0 if self.cancelled or paused else FINISH_CHECKS_S)
        coord.stop_nodes(grace=10.0)
        if self.health is not None:
            self.ledger.devices = [{"device": r.device, "state": r.state.value, "reason": r.reason}
                                   for r in self.health.registry.devices() if r.device in self.health.devices]
        self.ledger.nodes = coord.nodes.describe()
        report = {**self.ledger.report(), "loans": self.loans, "pauses": self.pauses,
                  **self.policy.describe()}
        self.code = code
        if paused and self._requeue(report):
            self._on_end(self)
            return
        self.db.ended(self.job, state, code, message, report)
        if self.observer is not None:          # run_end, with the report's totals (after the database has it)
            self.observer.close(code, report)
        self.log(f"job {state} (exit status {code})" + (f": {message.splitlines()[0]}" if message else ""))
        self._on_end(self)

    def _requeue(self, report: dict[str, Any]) -> bool:
        """A paused job goes back to the queue, to resume from the checkpoint its pause wrote
        (or its newest one); whether it did (not if it was cancelled meanwhile)."""
        ckpt, loan = self.coord.view.checkpoint, self.pausing
        record = pause_record(ev.to_record(loan), report, ckpt, self._pause_asked_at, time.time())
        request = resume_request(self.request or {}, ckpt.path if ckpt is not None else None)
        where = (f"resumes from {ckpt.path} (step {ckpt.step})" if ckpt is not None
                 else "no checkpoint: it starts again as submitted")
        message = f"paused to lend {', '.join(loan.hosts)} to {loan.borrower}; {where}"
        if not self.db.requeue(self.job, request, record, message):
            return False
        self.db.event(message + f" ({record['lost_steps']} step(s) lost, pause took {record['pause_s']:.2f} s)",
                      self.job)
        self.log(f"PAUSED  {message}; {record['lost_steps']} step(s) lost; queued again")
        return True

    # ------------------------------------------------------------------ persistence
    def _save(self, force: bool = False) -> None:
        v, n = self.coord.view, self.coord.nodes
        key = (v.generation, v.phase, tuple(sorted(v.members.items())), tuple(v.ready_spares), v.starting,
               tuple(sorted(v.lost)), tuple(sorted(v.reports.items())), tuple(sorted(v.done)), v.stopping,
               len(n.workers), sum(w.exit_code is not None for w in n.workers.values()),
               len(self.ledger.failures), len(self.ledger.migrations), tuple(n.detached()))
        now = time.time()
        if force or key != self._saved_key or now - self._saved_at >= SAVE_EVERY_S:
            self.db.save_state(self.job, persist.capture(self.coord), backup=force)
            self._saved_key, self._saved_at = key, now

    def _rejoin(self, state: dict[str, Any]) -> None:
        """After a restart: the saved state back in, then the agents' re-registrations and what
        they replay; nodes not back within a lease and a margin are lost."""
        coord = self.coord
        waiting = persist.restore(coord, state)
        self.log(f"resumed from the database at generation {coord.view.generation} ({coord.view.phase}); "
                 f"waiting up to {self.lease + self.margin + REJOIN_SLACK_S:.1f} s for node(s) "
                 f"{', '.join(waiting) or '-'} to re-register")
        deadline = time.time() + self.lease + self.margin + REJOIN_SLACK_S
        deferred = []
        while coord.nodes.detached() and time.time() < deadline:
            try:
                event = self.events.get(timeout=max(0.01, deadline - time.time()))
            except queue.Empty:
                break
            if isinstance(event, (ev.NodeConnected, ev.NodeLost)):
                coord.handle(event)
            else:
                deferred.append(event)
        for name in coord.nodes.detached():
            self.log(f"NODE    {name}: did not re-register within {self.lease + self.margin:g} s of the "
                     "restart: declared lost")
            coord.handle(ev.NodeLost(name, None, time.time()))  # type: ignore[arg-type]
        for event in deferred:
            coord.handle(event)
        self._save(force=True)
        coord.resume()
