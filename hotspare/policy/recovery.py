"""How to recover from lost ranks: a pure function shared by the coordinator and the simulator.

The rule that makes "you only compute once" work: every rank of a data-parallel job holds a full
copy of the training state, and after a failure each surviving rank is either at the step in
flight (k, its optimizer already stepped) or one before it (k-1). Recovery adopts the *most
advanced* committed state, so nothing committed is lost and nothing is applied twice.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Mapping

Path = Literal["memory", "wait", "checkpoint", "stop"]


@dataclasses.dataclass(frozen=True)
class RecoveryPlan:
    path: Path                      # memory: go now; wait: replacements are starting; checkpoint/stop: no copy left
    target_step: int | None         # committed step every rank adopts (None when stopping)
    source: int | None              # rank that sends the state
    receivers: tuple[int, ...]      # ranks that must receive it (replacements and laggards)
    warm: int                       # lost ranks filled from warm spares now
    start: int                      # processes to start (cold replacements) before recovery can go on
    reason: str


def plan_recovery(
    lost: set[int] | frozenset[int] | tuple[int, ...],
    committed: Mapping[int, int],
    warm_spares: int,
    starting: int = 0,
    checkpoint_step: int | None = None,
    job_step: int | None = None,
) -> RecoveryPlan:
    """Decide how to replace ``lost`` ranks.

    ``committed`` maps each *surviving* rank to its last committed step (-1 if none);
    ``warm_spares`` are idle workers ready now; ``starting`` are replacements already booting;
    ``job_step`` is the newest step any rank ever committed. A survivor more than one step behind
    it (e.g. a spare that joined but never received the state) holds no copy worth the name: it
    is a receiver, not a source, and if no survivor holds a copy the state is lost.
    """
    lost = tuple(sorted(set(lost)))
    gone = lost
    stale = {r for r, s in committed.items() if job_step is not None and s < job_step - 1}
    copies = {r: s for r, s in committed.items() if r not in stale}
    if not copies:
        lost = tuple(sorted(set(lost) | stale))
        committed = {}
    if not committed:
        # Every rank alive but none holding a copy: a sharded job whose lost shard is in no
        # survivor's memory (each rank reports -1, hotspare/sharded/fallback.py).
        why = (f"ranks {list(lost)} all lost" if gone else
               "no rank holds every shard of the newest step: a lost shard is in no survivor's memory")
        if checkpoint_step is not None:
            return RecoveryPlan("checkpoint", checkpoint_step, None, lost, 0, 0,
                                f"no in-memory copy survives ({why}): "
                                f"falling back to the checkpoint at step {checkpoint_step}")
        return RecoveryPlan("stop", None, None, lost, 0, 0,
                            f"no in-memory copy of the state survives ({why}) and no checkpoint exists"
                            + ("" if gone else " (write them with --checkpoint-dir DIR --checkpoint-every N)"))
    target = max(copies.values())
    source = min(r for r, s in copies.items() if s == target)
    laggards = tuple(r for r, s in sorted(committed.items()) if s < target)
    receivers = tuple(sorted(set(lost) | set(laggards)))
    lag_note = f"; ranks {list(laggards)} were one step behind and catch up" if laggards else ""
    if warm_spares >= len(lost):
        what = f"{len(lost)} warm spare{'s' if len(lost) != 1 else ''} replace{'s' if len(lost) == 1 else ''} rank{'s' if len(lost) != 1 else ''} {list(lost)}" if lost else "same members re-form"
        return RecoveryPlan("memory", target, source, receivers, len(lost), 0,
                            f"{what}; state of step {target} comes from rank {source}{lag_note}")
    deficit = len(lost) - warm_spares
    start = max(0, deficit - starting)
    return RecoveryPlan("wait", target, source, receivers, warm_spares, start,
                        f"{len(lost)} rank(s) lost but only {warm_spares} warm spare(s): starting "
                        f"{start} cold replacement(s) ({starting} already starting); state stays in memory")
