"""The policy's picture of the job (``ClusterView``), and the two functions that change it.

``observe(view, signal)`` records the facts a signal carries (who is ready, who died, who reported
which committed step); ``apply(view, action)`` records the effect of an action the coordinator
executed. ``decide`` (``policy.decide``) only reads the view. The phase moves only along
``policy.phase.TABLE``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hotspare.policy.actions import (AbortGeneration, Action, CheckpointNow, Fence, FormGeneration,
                                     Pause, Regrow, Release, StartSpares, Stop)
from hotspare.policy.phase import JobPhase, advance
from hotspare.policy.signals import (Checkpointed, Crashed, Done, HealthVerdict, Paused, Signal,
                                     StepFailed, WorkerExited, WorkerReady)

# the verdict actions the policy acts on (hotspare.health.types.ACTIONS; "watch" and "ignore" only report)
MIGRATE, FAILOVER, QUARANTINE, RETIRE = "migrate", "failover", "quarantine", "retire"
TAKES_ACTION = (MIGRATE, FAILOVER, QUARANTINE, RETIRE)


@dataclass
class ClusterView:
    world_size: int
    target_spares: int
    generation: int = 0
    phase: JobPhase = JobPhase.STARTING
    members: dict[int, str] = field(default_factory=dict)        # rank -> worker, current gen
    ready_actives: dict[int, str] = field(default_factory=dict)  # before the first generation
    ready_spares: list[str] = field(default_factory=list)
    starting: int = 0                                            # spares launched, not ready yet
    lost: set[int] = field(default_factory=set)                  # ranks of this gen whose worker died
    reports: dict[int, int] = field(default_factory=dict)        # rank -> committed, this gen's survivors
    ready_workers: set[str] = field(default_factory=set)         # workers that ever said ready
    crashes: list[Crashed] = field(default_factory=list)
    done: dict[int, Done] = field(default_factory=dict)
    reforms: dict[int, int] = field(default_factory=dict)        # step -> re-forms with nobody lost
    fenced: set[int] = field(default_factory=set)                # ranks of this gen being fenced
    aborted: bool = False                                        # this gen was aborted for a stall
    checkpoint: Checkpointed | None = None                       # newest persistent checkpoint
    resume: str | None = None                                    # --resume: restore gen 1 from here
    replacements_left: int | None = None                         # processes we may still start (None: no limit)
    capacity_wait: float = 60.0                                  # seconds to wait for capacity, then stop
    stopping: str | None = None                                  # waiting for a last checkpoint, then stop
    job_step: int = -1                                           # newest step any rank ever committed
    migrating: Pause | None = None                               # a live migration in flight
    health_failures: dict[tuple[int, int], list[str]] = field(default_factory=dict)  # (rank, step) -> workers
    boot_kills: int = 0                                          # spares killed while starting, in a row
    elastic_min: int | None = None                               # --elastic MIN: may shrink to MIN ranks
    placement: tuple[int, ...] | None = None                     # elastic: virtual rank -> rank, this gen
    regrowing: Regrow | None = None                              # an elastic job growing back

    def rank_of(self, worker: str) -> int | None:
        for r, w in self.members.items():
            if w == worker:
                return r
        return None


def observe(view: ClusterView, sig: Signal) -> None:
    """Record the facts of ``sig`` in ``view`` (no decisions here)."""
    if isinstance(sig, WorkerReady):
        if sig.worker in view.ready_workers:
            return           # said again (an agent repeats it to a restarted coordinator): nothing new
        view.ready_workers.add(sig.worker)
        if sig.role == "spare":
            view.starting = max(0, view.starting - 1)
            view.boot_kills = 0
            if sig.worker not in view.ready_spares:
                view.ready_spares.append(sig.worker)
        elif sig.rank is not None:
            view.ready_actives[sig.rank] = sig.worker
    elif isinstance(sig, WorkerExited):
        if sig.worker in view.ready_spares:
            view.ready_spares.remove(sig.worker)
        elif sig.worker not in view.ready_workers and view.rank_of(sig.worker) is None:
            view.starting = max(0, view.starting - 1)
            if sig.spare and sig.code < 0 and not sig.node_lost:
                view.boot_kills += 1
        rank = view.rank_of(sig.worker)
        if rank is not None and view.phase.active and rank not in view.done:
            view.lost.add(rank)
            view.reports.pop(rank, None)
            if view.phase is JobPhase.RUNNING:
                view.phase = advance(view.phase, JobPhase.RECOVERING)
    elif isinstance(sig, StepFailed):
        if sig.gen == view.generation and view.members.get(sig.rank) == sig.worker:
            view.reports[sig.rank] = sig.committed
            if view.phase is JobPhase.RUNNING:
                view.phase = advance(view.phase, JobPhase.RECOVERING)
    elif isinstance(sig, Paused):
        if sig.gen == view.generation and view.members.get(sig.rank) == sig.worker:
            view.reports[sig.rank] = sig.committed
    elif isinstance(sig, Crashed):
        view.crashes.append(sig)
    elif isinstance(sig, Done):
        if sig.gen == view.generation and view.members.get(sig.rank) == sig.worker:
            view.done[sig.rank] = sig
            # A finished rank waits to be released: if another rank is lost now, it counts as a
            # survivor that has reported its (last) committed step, never as a silent one.
            view.reports[sig.rank] = sig.step
    elif isinstance(sig, Checkpointed):
        if view.checkpoint is None or sig.step >= view.checkpoint.step:
            view.checkpoint = sig
    elif isinstance(sig, HealthVerdict):
        # An in-process check (the vote, NaN) that failed a step on a worker: a step failing on a
        # second device is the script's, not the hardware's (``decide`` stops the job then).
        rank = sig.rank if sig.rank in view.members and sig.rank not in view.lost else None
        if sig.step is not None and rank is not None and sig.action in TAKES_ACTION:
            seen = view.health_failures.setdefault((rank, sig.step), [])
            if sig.worker not in seen:
                seen.append(sig.worker)


def apply(view: ClusterView, action: Action) -> None:
    """Record the effect of an executed action."""
    if isinstance(action, FormGeneration):
        view.generation = action.gen
        view.members = dict(action.members)
        view.ready_spares = [w for w in view.ready_spares if w not in action.replacements.values()]
        if action.placement is not None:
            view.placement = action.placement
        if not view.lost and action.handoff_from is None and not action.regrow:
            view.reforms[action.target + 1] = view.reforms.get(action.target + 1, 0) + (action.gen > 1)
        view.lost, view.reports, view.done = set(), {}, {}
        view.fenced, view.aborted = set(), False
        view.migrating, view.regrowing = None, None
        view.phase = advance(view.phase, JobPhase.RUNNING)
    elif isinstance(action, StartSpares):
        view.starting += action.count
        if view.replacements_left is not None:
            view.replacements_left -= action.count
    elif isinstance(action, CheckpointNow):
        view.stopping = action.reason
    elif isinstance(action, Fence):
        view.fenced.update(action.ranks)
    elif isinstance(action, AbortGeneration):
        view.aborted = True
    elif isinstance(action, Pause):
        view.migrating = action
        view.phase = advance(view.phase, JobPhase.RECOVERING)
    elif isinstance(action, Regrow):
        view.regrowing = action
        view.phase = advance(view.phase, JobPhase.RECOVERING)
    elif isinstance(action, Release):
        view.phase = advance(view.phase, JobPhase.FINISHED)
    elif isinstance(action, Stop):
        view.phase = advance(view.phase, JobPhase.STOPPED)
