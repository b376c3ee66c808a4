"""The coordinator's decisions as a pure function: ``decide(view, signal, now) -> Decision``.

``decide`` reads the view (``policy.view.ClusterView``; ``observe`` has recorded the signal's facts
in it first) and returns the actions to take, a human-readable reason, which reaches the log and
the report, and a ``ReasonCode`` for code that must tell decisions apart (never the prose). It
changes nothing: the coordinator executes the actions and records their effect with ``apply``.
No I/O, no clocks, no torch: the tests script signals straight into it, and the simulator can
replay it.

Generation lifecycle (``policy.phase``)::

    starting --(all ranks ready)--> running --(member lost / step failed)--> recovering
    recovering --(survivors reported + spares ready)--> running (generation + 1)
    running --(every rank done)--> finished          any --(bug / no copy left)--> stopped

The signals, actions and view live in ``policy.signals``, ``policy.actions`` and ``policy.view``;
their names are importable from here too.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from hotspare.policy.actions import (AbortGeneration, Action, CheckpointNow, Cordon, Fence,
                                     FormGeneration, Pause, Regrow, Release, StartSpares, Stop)
from hotspare.policy.hang import RankActivity, find_hung
from hotspare.policy.phase import JobPhase
from hotspare.policy.recovery import plan_recovery
from hotspare.policy.shrink import decide_regrow, decide_shrink, holders_of, layout
from hotspare.policy.signals import (Checkpointed, Crashed, Done, FailureCause, HealthVerdict, Paused,
                                     Signal, StepFailed, Tick, WorkerExited, WorkerReady)
from hotspare.policy.view import (FAILOVER, MIGRATE, QUARANTINE, RETIRE, TAKES_ACTION, ClusterView,
                                  apply, observe)

ABORT_GRACE_S = 0.5   # after a member is lost, survivors get this long to fail (or finish) on their own
MAX_BOOT_KILLS = 4    # spares killed while they start, in a row, before the job gives up on spares


class ReasonCode(enum.Enum):
    """What kind of decision it was, for code (the reason's words are for people)."""
    OTHER = "other"
    JOB_OVER = "job over"
    HEALTH_NO_ACTION = "health: report only"            # watch / ignore
    HEALTH_STOP = "health: fails on every device"
    HEALTH_CORDON_IDLE = "health: cordon an idle device"
    HEALTH_ALREADY_FENCING = "health: already fencing"
    HEALTH_FENCE = "health: fence"
    HEALTH_DEFERRED = "health: deferred"
    HEALTH_NO_SPARE = "health: no spare to move to"
    HEALTH_MIGRATE = "health: migrate"


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    reason: str
    code: ReasonCode = ReasonCode.OTHER


def decide(view: ClusterView, sig: Signal, now: float = 0.0) -> Decision:
    if view.phase.over:
        return Decision((), f"job already {view.phase}", ReasonCode.JOB_OVER)

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

    if isinstance(sig, Crashed) and sig.refused:
        what = sig.error.split(": ", 1)[-1]
        return Decision((Stop(1, f"rank {sig.rank} refused to start the job: {what}"),),
                        "the job cannot run as configured")
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
        if view.phase is not JobPhase.RECOVERING and _spares_needed(view) > 0:
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
            if view.phase is not JobPhase.FINISHED and _spares_needed(view) > 0:
                actions.append(StartSpares(_spares_needed(view)))
                reasons.append(f"spare {sig.worker} exited; starting a new one")

    if view.phase is JobPhase.STARTING:
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
    if view.phase is JobPhase.RECOVERING and not (all_done and view.migrating is not None):
        d = _recover(view)
        actions += d.actions
        reasons.append(d.reason)
    elif all_done:      # (a migration asked for after the last step has nothing left to move)
        final = {d.step for d in view.done.values()}
        actions.append(Release(f"all ranks finished step {max(final)}"))
        reasons.append("training complete")
    else:
        d = _regrow(view)
        actions += d.actions
        reasons += [d.reason] if d.actions else []
    return Decision(tuple(actions), "; ".join(reasons) or "nothing to do")


def _regrow(view: ClusterView) -> Decision:
    """An elastic job running shrunk, a spare ready: grow back at the next step boundary."""
    if (view.placement is None or view.phase is not JobPhase.RUNNING or view.migrating is not None
            or view.regrowing is not None or view.done):
        return Decision((), "")
    r = decide_regrow(holders_of(view.members, view.placement), view.ready_spares)
    if r is None:
        return Decision((), "")
    _, placement = layout(r.holders)
    return Decision((Regrow(view.generation, r.vrank, r.spare, placement, r.reason),), r.reason)


def _regrown(view: ClusterView) -> Decision:
    """Every rank paused at the same step for a regrow: the spare joins with its virtual rank."""
    g = view.regrowing
    steps = set(view.reports.values())
    if g.spare not in view.ready_spares or len(steps) != 1:
        return Decision((), f"growing back: waiting for every rank to pause (steps {sorted(steps)})")
    target = steps.pop()
    members, placement = layout({**holders_of(view.members, view.placement), g.vrank: g.spare})
    rank = next(r for r, w in members.items() if w == g.spare)
    form = FormGeneration(view.generation + 1, members, target, 0, (rank,), {rank: g.spare},
                          placement=placement, before=view.placement, regrow=True)
    return Decision((form,), f"all ranks paused after step {target}: {g.reason}; generation {view.generation + 1}")


def _shrink(view: ClusterView, plan) -> Decision | None:
    """No spare ready for an elastic job's lost ranks: go on with fewer (policy/shrink.py)."""
    s = decide_shrink(holders_of(view.members, view.placement), [view.members[r] for r in sorted(view.lost)],
                      view.elastic_min, len(view.ready_spares))
    if s is None:
        return None
    members, placement = layout(s.holders)
    rank = {w: r for r, w in members.items()}
    source = rank[view.members[plan.source]]
    receivers = tuple(sorted(rank[view.members[r]] for r in plan.receivers if r not in view.lost))
    form = FormGeneration(view.generation + 1, members, plan.target_step, source, receivers,
                          placement=placement, before=view.placement)
    start = _can_start(view, plan.start)      # replacements still start: the job grows back on them
    return Decision((form, StartSpares(start)) if start else (form,),
                    f"{s.reason}; state of step {plan.target_step} stays in memory")


def _on_health(view: ClusterView, v: HealthVerdict) -> Decision:
    """Act on a health verdict: live-migrate a rank whose device still computes correctly,
    fail over one whose memory is not trusted, and cordon the device either way."""
    what = f"{v.device} ({v.rule}): {v.reason}"
    if v.action not in TAKES_ACTION:
        return Decision((), f"{v.action}: {what}", ReasonCode.HEALTH_NO_ACTION)
    rank = v.rank if v.rank in view.members and v.rank not in view.lost else None
    cordon = Cordon(v.device, v.reason, v.rule, retire=v.action == RETIRE)
    seen = view.health_failures.get((rank, v.step), []) if v.step is not None and rank is not None else []
    if len(seen) >= 2:          # (observe recorded this verdict's worker)
        msg = (f"rank {rank} failed the health check at step {v.step} on worker {seen[0]} and again on "
               f"replacement {seen[-1]} ({v.reason}). Faulty hardware does not follow a rank to a new "
               "device: this looks like a numerical problem in the script or its data (e.g. a NaN "
               "from this rank's batch), so hotspare stops instead of failing over forever.")
        return Decision((Stop(1, msg),), f"step {v.step} of rank {rank} fails on every device",
                        ReasonCode.HEALTH_STOP)
    if rank is None or not view.phase.active:
        return Decision((cordon,), f"{v.action}: {what}; no rank runs there: cordoning the device",
                        ReasonCode.HEALTH_CORDON_IDLE)
    if v.action == FAILOVER or not v.trust_memory:
        if rank in view.fenced:
            return Decision((), f"rank {rank} already being fenced: {what}", ReasonCode.HEALTH_ALREADY_FENCING)
        reason = f"rank {rank} on {what}; its memory is not trusted: fencing it, state from a healthy replica"
        return Decision((Fence((rank,), reason, FailureCause.HEALTH, v.rule), cordon), reason,
                        ReasonCode.HEALTH_FENCE)
    if view.phase is not JobPhase.RUNNING or view.migrating is not None:
        return Decision((), f"{v.action} of rank {rank} deferred (job {view.phase}): {what}",
                        ReasonCode.HEALTH_DEFERRED)
    if not view.ready_spares:
        return Decision((), f"rank {rank} should move off {v.device} but no warm spare is ready: "
                            f"reported only; {v.reason}", ReasonCode.HEALTH_NO_SPARE)
    spare = view.ready_spares[0]
    reason = (f"rank {rank} on {what}; live-migrating it to spare {spare} at the next step boundary "
              "(its memory is still good)")
    return Decision((Pause(view.generation, rank, spare, v.device, reason, v.rule), cordon), reason,
                    ReasonCode.HEALTH_MIGRATE)


def _on_tick(view: ClusterView, tick: Tick) -> Decision:
    if view.phase is JobPhase.RUNNING:
        fencing = sorted(view.fenced - view.lost)
        if fencing:
            # The stall's cause is being removed: its exit starts a recovery that aborts the
            # generation and frees the ranks blocked behind it (in a collective before the
            # gradient exchange, say). Judging them now would fence healthy ranks.
            return Decision((), f"waiting for fenced rank(s) {fencing} to exit")
        active = tuple(a for a in tick.activity if a.rank not in view.fenced)
        hung, reason = find_hung(active, tick.stalled_for, tick.limit)
        if hung:
            return Decision((Fence(hung, reason),), reason)
        if reason and not view.aborted:
            return Decision((AbortGeneration(view.generation, tuple(sorted(view.members))),), reason)
    elif view.phase is JobPhase.RECOVERING:
        silent = tuple(sorted(set(view.members) - view.lost - set(view.reports) - view.fenced))
        # A live migration waits for the step in flight to end (up to the hang limit); a
        # failure frees the blocked survivors at once.
        pausing = view.migrating is not None or view.regrowing is not None
        grace = tick.limit if pausing and not view.lost else ABORT_GRACE_S
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
    if view.stopping and view.phase is JobPhase.RECOVERING and tick.recovering_for >= view.capacity_wait + 60:
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
    if view.regrowing is not None and not view.lost:
        return _regrown(view)
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
    if plan.path == "wait" and view.placement is not None:
        d = _shrink(view, plan)
        if d is not None:
            return d
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


__all__ = ["ABORT_GRACE_S", "MAX_BOOT_KILLS", "FAILOVER", "MIGRATE", "QUARANTINE", "RETIRE", "TAKES_ACTION",
           "AbortGeneration", "Action", "CheckpointNow", "Checkpointed", "ClusterView", "Cordon", "Crashed",
           "Decision", "Done", "FailureCause", "Fence", "FormGeneration", "HealthVerdict", "JobPhase", "Pause",
           "Paused", "RankActivity", "ReasonCode", "Regrow", "Release", "Signal", "StartSpares", "StepFailed", "Stop",
           "Tick", "WorkerExited", "WorkerReady", "apply", "decide", "observe"]
