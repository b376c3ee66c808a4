"""The coordinator's decisions as a pure function: ``decide(view, signal, now) -> Decision``.

``observe(view, signal)`` records the facts a signal carries (who is ready, who died, who reported
which committed step); ``decide`` reads the view and returns the actions to take and a
human-readable reason, which reaches the log and the report; the coordinator executes the
actions and records their effect with ``apply``. No I/O, no clocks, no torch: the tests script
signals straight into it, and the simulator can replay it.

Generation lifecycle::

    starting --(all ranks ready)--> running --(member lost / step failed)--> recovering
    recovering --(survivors reported + spares ready)--> running (generation + 1)
    running --(every rank done)--> finished          any --(bug / no copy left)--> stopped
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from hotspare.policy.hang import RankActivity, find_hung
from hotspare.policy.recovery import plan_recovery


ABORT_GRACE_S = 0.5   # after a member is lost, survivors get this long to fail (or finish) on their own
MAX_BOOT_KILLS = 4    # spares killed while they start, in a row, before the job gives up on spares


# ---------------------------------------------------------------------------- signals
@dataclass(frozen=True)
class WorkerReady:
    worker: str
    role: str                  # "active" (rank known from launch) or "spare"
    rank: int | None = None


@dataclass(frozen=True)
class WorkerExited:
    worker: str
    code: int                  # negative: killed by that signal
    description: str = ""
    node_lost: bool = False    # lost with its node agent's link, not seen to exit by itself
    spare: bool = False        # started as a spare (else as one of the initial ranks)


@dataclass(frozen=True)
class StepFailed:
    worker: str
    rank: int
    gen: int
    committed: int
    error: str = ""


@dataclass(frozen=True)
class Crashed:
    worker: str
    rank: int
    gen: int
    step: int
    error: str
    traceback: str = ""


@dataclass(frozen=True)
class Done:
    worker: str
    rank: int
    gen: int
    step: int
    digest: str


@dataclass(frozen=True)
class Checkpointed:
    """A persistent checkpoint of ``step`` finished writing at ``path`` (the last resort)."""
    step: int
    path: str


@dataclass(frozen=True)
class Tick:
    """Periodic: the heartbeat picture the hang detector needs (see policy/hang.py)."""
    activity: tuple[RankActivity, ...]
    stalled_for: float         # seconds since the last committed step (or the generation formed)
    recovering_for: float      # seconds since this recovery began (0 when running)
    limit: float               # the hang threshold now


@dataclass(frozen=True)
class HealthVerdict:
    """The health rules judged the device under ``rank`` (see hotspare/health/rules.py)."""
    device: str
    rank: int | None
    action: str                # hotspare.health.types.ACTIONS
    reason: str
    trust_memory: bool = True  # False: the rank's state must come from a replica
    rule: str = ""
    step: int | None = None    # in-process signals (fingerprint vote, NaN): the step they failed
    worker: str = ""


@dataclass(frozen=True)
class Paused:
    """A rank left its generation at a step boundary, as a live migration asked."""
    worker: str
    rank: int
    gen: int
    committed: int


Signal = Union[WorkerReady, WorkerExited, StepFailed, Crashed, Done, Checkpointed, Tick, HealthVerdict, Paused]


# ---------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class FormGeneration:
    gen: int
    members: dict[int, str]    # rank -> worker
    target: int                # committed step every rank adopts
    source: int
    receivers: tuple[int, ...]
    replacements: dict[int, str] = field(default_factory=dict)   # rank -> spare that takes it
    restore: str | None = None  # every rank loads this checkpoint instead of receiving from a peer
    handoff_from: str | None = None  # live migration: this old worker sends its state to the spare


@dataclass(frozen=True)
class AbortGeneration:
    gen: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Fence:
    """Kill these ranks' processes for sure (process group, SIGKILL) before reassigning them."""
    ranks: tuple[int, ...]
    reason: str
    kind: str = "hang"         # what the failure record calls it: "hang" or "health:<rule>"


@dataclass(frozen=True)
class CheckpointNow:
    """Ask a surviving rank to write a synchronous checkpoint before the job stops."""
    rank: int
    reason: str


@dataclass(frozen=True)
class Pause:
    """Live migration, first half: every rank of ``gen`` leaves it at the next step boundary
    (agreed inside the gradient exchange, so all stop after the same step); then ``rank``
    hands its state to ``spare`` directly, its memory still being good."""
    gen: int
    rank: int
    spare: str
    device: str
    reason: str
    rule: str = ""


@dataclass(frozen=True)
class Cordon:
    """Take a device out of service: no new work; drained, then quarantine diagnostics."""
    device: str
    reason: str
    rule: str = ""
    retire: bool = False       # a repeat offender: retire it once drained instead of diagnosing


@dataclass(frozen=True)
class StartSpares:
    count: int


@dataclass(frozen=True)
class Release:
    reason: str


@dataclass(frozen=True)
class Stop:
    code: int
    message: str


Action = Union[FormGeneration, AbortGeneration, Fence, CheckpointNow, StartSpares, Release, Stop, Pause, Cordon]


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    reason: str


# ---------------------------------------------------------------------------- the view
@dataclass
class ClusterView:
    world_size: int
    target_spares: int
    generation: int = 0
    phase: str = "starting"
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

    def rank_of(self, worker: str) -> int | None:
        for r, w in self.members.items():
            if w == worker:
                return r
        return None


def observe(view: ClusterView, sig: Signal) -> None:
    """Record the facts of ``sig`` in ``view`` (no decisions here)."""
    if isinstance(sig, WorkerReady):
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
        if rank is not None and view.phase in ("running", "recovering") and rank not in view.done:
            view.lost.add(rank)
            view.reports.pop(rank, None)
            if view.phase == "running":
                view.phase = "recovering"
    elif isinstance(sig, StepFailed):
        if sig.gen == view.generation and view.members.get(sig.rank) == sig.worker:
            view.reports[sig.rank] = sig.committed
            if view.phase == "running":
                view.phase = "recovering"
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


def apply(view: ClusterView, action: Action) -> None:
    """Record the effect of an executed action."""
    if isinstance(action, FormGeneration):
        view.generation = action.gen
        view.members = dict(action.members)
        view.ready_spares = [w for w in view.ready_spares if w not in action.replacements.values()]
        if not view.lost and action.handoff_from is None:
            view.reforms[action.target + 1] = view.reforms.get(action.target + 1, 0) + (action.gen > 1)
        view.lost, view.reports, view.done = set(), {}, {}
        view.fenced, view.aborted = set(), False
        view.migrating = None
        view.phase = "running"
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
        view.phase = "recovering"
    elif isinstance(action, Release):
        view.phase = "finished"
    elif isinstance(action, Stop):
        view.phase = "stopped"


# ---------------------------------------------------------------------------- decisions
def decide(view: ClusterView, sig: Signal, now: float = 0.0) -> Decision:
    if view.phase in ("finished", "stopped"):
        return Decision((), f"job already {view.phase}")

    if isinstance(sig, Tick):
        return _on_tick(view, sig)

    if isinstance(sig, HealthVerdict):
        return _on_health(view, sig)

    if isinstance(sig, Checkpointed):
        if view.stopping:
            return Decision((Stop(1, f"{view.stopping} A checkpoint of step {sig.step} is at {sig.path}; "
                                     f"continue with: hotspare run --resume {_parent(sig.path)} ..."),),
                            "last checkpoint written")
        return Decision((), f"checkpoint of step {sig.step} written")

    if isinstance(sig, Crashed):
        repeat = [c for c in view.crashes[:-1] if c.step == sig.step and c.worker != sig.worker]
        if repeat:
            first = repeat[0]
            return Decision((Stop(1, _bug_message(first, sig)),),
                            f"step {sig.step} raised on worker {first.worker} and again on {sig.worker}")
        return Decision((), f"rank {sig.rank} raised {sig.error.splitlines()[0][:120]} at step {sig.step}; "
                            "failing over once (a second failure of the same step means a bug)")

    actions: list[Action] = []
    reasons: list[str] = []
    if isinstance(sig, WorkerExited) and sig.worker not in view.ready_workers \
            and view.rank_of(sig.worker) is None and not sig.node_lost:
        if sig.code == 0:
            return Decision((Stop(1, f"worker {sig.worker} exited with code 0 before calling hotspare.init() "
                                     "(or before job.steps()): did the script run its training? (e.g. it "
                                     "only printed --help, or returned early; see its output above)"),),
                            "a worker ended before it started training")
        if sig.code > 0 or not sig.spare:
            return Decision((Stop(1, f"worker {sig.worker} {sig.description or f'exited with code {sig.code}'} "
                                     "before it was ready: the training script failed to start (see its "
                                     "output above)"),), "startup failure")
        # A spare killed by a signal while it booted: a fault like any other, not the script's.
        if view.boot_kills > MAX_BOOT_KILLS:
            return Decision((Stop(1, f"{view.boot_kills} spares in a row were killed while they started "
                                     f"(the last, {sig.worker}, {sig.description}): something on this node "
                                     "kills new processes (out of memory?); stopping instead of starting more"),),
                            "spares keep dying while they start")
        if view.phase != "recovering" and _spares_needed(view) > 0:
            actions.append(StartSpares(_spares_needed(view)))
        reasons.append(f"spare {sig.worker} {sig.description or 'was killed'} while it started; "
                       "starting another")
    if isinstance(sig, WorkerExited):
        rank = next((r for r in view.lost if view.members.get(r) == sig.worker), None)
        if rank is not None:
            # No abort yet: a collective that does not need the dead rank any more may still
            # complete on the survivors (a rank that finished step k must not drag the others
            # back to k-1); those that touch it fail at once, and a failing survivor aborts its
            # own generation, which frees whoever waits for it. The abort is a backstop (Tick).
            reasons.append(f"rank {rank} ({sig.worker}) {sig.description or 'exited'}")
        elif sig.worker in view.ready_workers and view.rank_of(sig.worker) is None:
            if view.phase != "finished" and _spares_needed(view) > 0:
                actions.append(StartSpares(_spares_needed(view)))
                reasons.append(f"spare {sig.worker} exited; starting a new one")

    if view.phase == "starting":
        if len(view.ready_actives) == view.world_size:
            members = dict(sorted(view.ready_actives.items()))
            if view.resume:
                actions.append(FormGeneration(1, members, -1, -1, tuple(range(view.world_size)),
                                              restore=view.resume))
                reasons.append(f"all {view.world_size} ranks ready: generation 1, resuming from {view.resume}")
            else:
                actions.append(FormGeneration(1, members, -1, 0, tuple(range(1, view.world_size))))
                reasons.append(f"all {view.world_size} ranks ready: generation 1, initial state from rank 0")
        return Decision(tuple(actions), "; ".join(reasons) or "waiting for ranks to start")

    all_done = bool(view.done) and len(view.done) == len(view.members) and not view.lost
    if view.phase == "recovering" and not (all_done and view.migrating is not None):
        d = _recover(view)
        actions += d.actions
        reasons.append(d.reason)
    elif all_done:      # (a migration asked for after the last step has nothing left to move)
        final = {d.step for d in view.done.values()}
        actions.append(Release(f"all ranks finished step {max(final)}"))
        reasons.append("training complete")
    return Decision(tuple(actions), "; ".join(reasons) or "nothing to do")


MIGRATE, FAILOVER, QUARANTINE, RETIRE = "migrate", "failover", "quarantine", "retire"


def _on_health(view: ClusterView, v: HealthVerdict) -> Decision:
    """Act on a health verdict: live-migrate a rank whose device still computes correctly,
    fail over one whose memory is not trusted, and cordon the device either way."""
    what = f"{v.device} ({v.rule}): {v.reason}"
    if v.action not in (MIGRATE, FAILOVER, QUARANTINE, RETIRE):
        return Decision((), f"{v.action}: {what}")
    rank = v.rank if v.rank in view.members and v.rank not in view.lost else None
    cordon = Cordon(v.device, v.reason, v.rule, retire=v.action == RETIRE)
    if v.step is not None and rank is not None:
        seen = view.health_failures.setdefault((rank, v.step), [])
        if v.worker not in seen:
            seen.append(v.worker)
        if len(seen) >= 2:
            msg = (f"rank {rank} failed the health check at step {v.step} on worker {seen[0]} and again on "
                   f"replacement {seen[-1]} ({v.reason}). Faulty hardware does not follow a rank to a new "
                   "device: this looks like a numerical problem in the script or its data (e.g. a NaN "
                   "from this rank's batch), so hotspare stops instead of failing over forever.")
            return Decision((Stop(1, msg),), f"step {v.step} of rank {rank} fails on every device")
    if rank is None or view.phase not in ("running", "recovering"):
        return Decision((cordon,), f"{v.action}: {what}; no rank runs there: cordoning the device")
    if v.action == FAILOVER or not v.trust_memory:
        if rank in view.fenced:
            return Decision((), f"rank {rank} already being fenced: {what}")
        reason = f"rank {rank} on {what}; its memory is not trusted: fencing it, state from a healthy replica"
        return Decision((Fence((rank,), reason, kind=f"health:{v.rule}"), cordon), reason)
    if view.phase != "running" or view.migrating is not None:
        return Decision((), f"{v.action} of rank {rank} deferred (job {view.phase}): {what}")
    if not view.ready_spares:
        return Decision((), f"rank {rank} should move off {v.device} but no warm spare is ready: "
                            f"reported only; {v.reason}")
    spare = view.ready_spares[0]
    reason = (f"rank {rank} on {what}; live-migrating it to spare {spare} at the next step boundary "
              "(its memory is still good)")
    return Decision((Pause(view.generation, rank, spare, v.device, reason, v.rule), cordon), reason)


def _on_tick(view: ClusterView, tick: Tick) -> Decision:
    if view.phase == "running":
        active = tuple(a for a in tick.activity if a.rank not in view.fenced)
        hung, reason = find_hung(active, tick.stalled_for, tick.limit)
        if hung:
            return Decision((Fence(hung, reason),), reason)
        if reason and not view.aborted:
            return Decision((AbortGeneration(view.generation, tuple(sorted(view.members))),), reason)
    elif view.phase == "recovering":
        silent = tuple(sorted(set(view.members) - view.lost - set(view.reports) - view.fenced))
        # A live migration waits for the step in flight to end (up to the hang limit); a
        # failure frees the blocked survivors at once.
        grace = tick.limit if view.migrating is not None and not view.lost else ABORT_GRACE_S
        if silent and not view.aborted and tick.recovering_for >= grace:
            reason = f"rank(s) {list(silent)} still in generation {view.generation}: aborting it"
            return Decision((AbortGeneration(view.generation, silent),), reason)
        # Fence the silent only while a reported survivor still holds the state: fencing every
        # holder would turn a slow recovery into a lost one.
        # When nobody reported at all, wait three times as long before giving up on them:
        # never hang forever.
        patience = tick.limit if view.reports else 3 * tick.limit
        if silent and tick.recovering_for >= patience:
            reason = (f"rank(s) {list(silent)} did not report within {patience:.1f} s of the "
                      "recovery starting: fencing them as hung")
            return Decision((Fence(silent, reason),), reason)
        if (not silent and view.stopping is None and view.replacements_left == 0 and view.starting == 0
                and len(view.ready_spares) < len(view.lost) and tick.recovering_for >= view.capacity_wait):
            return _stop_for_capacity(view)
    if view.stopping and view.phase == "recovering" and tick.recovering_for >= view.capacity_wait + 60:
        return Decision((Stop(1, f"{view.stopping} The last checkpoint could not be written in time."),),
                        "gave up waiting for the last checkpoint")
    return Decision((), "")


def _stop_for_capacity(view: ClusterView) -> Decision:
    survivors = sorted(set(view.reports))
    reason = (f"{len(view.lost)} rank(s) lost and no capacity left to replace them (no warm spare, "
              f"--max-replacements used up) after waiting {view.capacity_wait:.0f} s: stopping.")
    if not survivors:
        return Decision((Stop(1, reason),), reason)
    return Decision((CheckpointNow(survivors[0], reason),),
                    f"{reason} Rank {survivors[0]} writes a last checkpoint first")


def _parent(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0] if "/" in path.rstrip("/") else "."


def _can_start(view: ClusterView, wanted: int) -> int:
    wanted = max(0, wanted)
    return wanted if view.replacements_left is None else min(wanted, view.replacements_left)


def _spares_needed(view: ClusterView) -> int:
    return _can_start(view, view.target_spares - len(view.ready_spares) - view.starting)


def _recover(view: ClusterView) -> Decision:
    survivors = set(view.members) - view.lost
    waiting = sorted(survivors - set(view.reports))
    if waiting:
        return Decision((), f"waiting for ranks {waiting} to report their committed step")
    fencing = sorted(view.fenced - view.lost)
    if fencing:      # their state is not trusted (or they hung): never a source; wait for the exit
        return Decision((), f"waiting for fenced rank(s) {fencing} to exit")
    m = view.migrating
    if m is not None and not view.lost and m.spare in view.ready_spares:
        steps = set(view.reports.values())
        if len(steps) == 1:
            target = steps.pop()
            members = {**view.members, m.rank: m.spare}
            form = FormGeneration(view.generation + 1, dict(sorted(members.items())), target, m.rank, (),
                                  {m.rank: m.spare}, handoff_from=view.members[m.rank])
            refill = _can_start(view, view.target_spares - (len(view.ready_spares) - 1) - view.starting)
            reason = (f"all ranks paused after step {target}: rank {m.rank} hands its state to spare "
                      f"{m.spare} directly; generation {view.generation + 1}")
            return Decision((form, StartSpares(refill)) if refill else (form,), reason)
    step = max(view.reports.values(), default=-1) + 1
    if not view.lost and view.reforms.get(step, 0) >= 2:
        return Decision((Stop(1, f"collectives keep failing at step {step} although no worker died "
                                 f"({view.reforms[step]} re-forms): this looks like a bug in the script, "
                                 "e.g. ranks calling different collectives or mismatched tensor shapes"),),
                        "repeated collective failure without a lost worker")
    if view.stopping:
        return Decision((), f"stopping: {view.stopping}")
    ckpt = view.checkpoint.step if view.checkpoint else None
    plan = plan_recovery(view.lost, view.reports, len(view.ready_spares), view.starting, ckpt,
                         job_step=view.job_step)
    if plan.path == "checkpoint":
        if len(view.ready_spares) < len(view.lost):
            start = _can_start(view, len(view.lost) - len(view.ready_spares) - view.starting)
            return Decision((StartSpares(start),) if start else (),
                            plan.reason + f"; waiting for {len(view.lost)} replacement(s)")
        replacements = dict(zip(sorted(view.lost), view.ready_spares))
        members = {**{r: w for r, w in view.members.items() if r not in view.lost}, **replacements}
        form = FormGeneration(view.generation + 1, dict(sorted(members.items())), plan.target_step,
                              -1, tuple(sorted(members)), replacements, restore=view.checkpoint.path)
        refill = _can_start(view, view.target_spares - (len(view.ready_spares) - len(replacements)) - view.starting)
        return Decision((form, StartSpares(refill)) if refill else (form,), plan.reason)
    if plan.path == "memory":
        replacements = dict(zip(sorted(view.lost), view.ready_spares))
        members = {**{r: w for r, w in view.members.items() if r not in view.lost}, **replacements}
        form = FormGeneration(view.generation + 1, dict(sorted(members.items())), plan.target_step,
                              plan.source, plan.receivers, replacements)
        spare_left = len(view.ready_spares) - len(replacements)
        refill = _can_start(view, view.target_spares - spare_left - view.starting)
        actions: tuple[Action, ...] = (form, StartSpares(refill)) if refill else (form,)
        return Decision(actions, plan.reason + (f"; re-provisioning {refill} spare(s)" if refill else ""))
    if plan.path == "wait":
        start = _can_start(view, plan.start)
        if plan.start and not start:
            return Decision((), f"{plan.reason}; no capacity left to start one: waiting up to "
                                f"{view.capacity_wait:.0f} s")
        return Decision((StartSpares(start),) if start else (), plan.reason)
    return Decision((Stop(1, plan.reason),), plan.reason)


def _bug_message(first: Crashed, again: Crashed) -> str:
    return (f"step {again.step} failed with an exception on worker {first.worker} (rank {first.rank}) and "
            f"again on {again.worker} (rank {again.rank}) after failover. A hardware fault does not follow "
            f"the step to a new process: this looks like a bug in the training script, so hotspare stops "
            f"instead of failing over forever.\n--- traceback (rank {again.rank}, step {again.step}) ---\n"
            f"{again.traceback.rstrip() or again.error}")


__all__ = [n for n in dir() if not n.startswith("_") and n not in ("annotations", "Union")]
