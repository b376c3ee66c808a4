"""A job paused to lend its devices, and resumed: what it needs and what it keeps (pure).

A lender is paused the way SIGTERM stops `hotspare run` (``coordinator.preempt``): every rank
leaves its step, the lowest survivor writes a signed checkpoint of the newest committed step
from memory to the job's --checkpoint-dir, and the job stops. The service then queues it again
with ``resume_request`` (its own flags, ``--resume`` that very checkpoint), so it resumes at
the step it was paused at, bit for bit, once capacity returns; ``pause_record`` is what its
report keeps of each pause. ``short_of`` is how a running job says it needs a device.

An ``--elastic`` lender above its minimum is not paused but shrinks (``hotspare.service.lending``):
``shrink_ranks`` is what the loan decision reads of it (its minimum and its live ranks per host,
only while it runs at a step boundary's pace: running, nothing lost, no regrow or migration in
flight), and ``regrow_slots`` how many device slots it lacks to grow back to its size.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from hotspare.policy.phase import JobPhase


def short_of(view, unplaced: int) -> int:
    """Device slots a job lacks for ranks it lost: spares it wants but no device can take
    (``unplaced``, the executor's count), while it recovers lost ranks. A job only short of
    its spare pool (no rank lost) asks nobody to pause for it."""
    if view.phase is not JobPhase.RECOVERING or not view.lost or view.stopping:
        return 0
    return min(unplaced, len(view.lost))


def resume_request(request: dict[str, Any], checkpoint: str | None) -> dict[str, Any]:
    """``request`` with its ``--resume`` replaced by ``checkpoint``; None (no checkpoint of this
    run, e.g. paused before its first step): the request as it was, which starts it where it
    started before (its own --resume, or an earlier pause's, or from scratch)."""
    if checkpoint is None:
        return dict(request)
    out, skip = [], False
    for a in (str(a) for a in request["run_args"]):
        if skip or a == "--resume":
            skip = not skip
            continue
        if not a.startswith("--resume="):
            out.append(a)
    return {**request, "run_args": out + ["--resume", checkpoint]}


def pause_record(loan: dict[str, Any], report: dict[str, Any], checkpoint, asked_at: float,
                 ended_at: float) -> dict[str, Any]:
    """What a paused job keeps of this pause: the loan (the typed event's record), the step it
    reached, the checkpoint it resumes from, the steps that checkpoint does not hold (0 when
    the pause's own checkpoint was written), and how long the pause took."""
    reached = int(report.get("steps_completed", 0)) - 1          # newest committed step (-1: none)
    step = checkpoint.step if checkpoint is not None else None
    lost = max(0, reached - step) if step is not None else reached + 1
    return {"loan": loan, "committed_step": reached, "checkpoint": checkpoint.path if checkpoint else None,
            "checkpoint_step": step, "lost_steps": lost, "pause_s": round(ended_at - asked_at, 3),
            "asked_at": asked_at, "ended_at": ended_at, "outcome": report.get("outcome"),
            "final_state_digest": report.get("final_state_digest")}


def shrink_ranks(view, elastic: int | None, node_of: Callable[[str], str]) -> tuple[int | None,
                                                                                  tuple[tuple[str, int], ...]]:
    """(its --elastic minimum, (host, live ranks there) ...) of a job that could shrink to lend a
    host now; (None, ()) when it cannot: not elastic, or not running steady (starting,
    recovering, a rank lost, a regrow or migration in flight, finishing)."""
    if (elastic is None or view.placement is None or view.phase is not JobPhase.RUNNING or view.lost
            or view.regrowing is not None or view.migrating is not None or view.done or view.stopping):
        return None, ()
    per_host = Counter(node_of(w) for w in set(dict(view.members).values()))
    return elastic, tuple(sorted(per_host.items()))


def regrow_slots(view, unplaced: int, coming: int = 0) -> int:
    """Device slots an elastic job running shrunk lacks to grow back: its virtual ranks run on
    fewer workers than it has virtual ranks, and spares wait for a device (``unplaced``), less
    the slots of hosts given back to it that no spare of it runs on yet (``coming``: never give
    one need twice while the first host is on its way)."""
    if view.placement is None or view.phase.over or view.stopping:
        return 0
    return max(0, min(len(view.placement) - len(set(dict(view.members).values())), unplaced) - coming)
