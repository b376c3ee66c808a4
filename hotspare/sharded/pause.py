"""The live-migration pause of a sharded job, carried by its step gate.

A DDP job's pause rides on the health vote (runtime/healthvote.py), which also compares the
replicas' parameter fingerprints: a sharded job's ranks hold different shards, so it has no such
vote. Here each rank adds one byte, "I was asked to pause", to the per-rank rows the sharded
step gate gathers anyway (runtime/rankstate.py ``RowTable.begin(flag=...)``), before any
optimizer steps (runtime/sharded.py): no collective of its own. A pause asked anywhere makes
every rank leave once this same step is committed, as a DDP job's vote does; the migrating rank
then hands its own state, its shards included, to the spare (runtime/membership.py ``handoff``).

(Until 2026-12-06 the vote was an all-reduce of its own, started as the step's first forward
began: on this machine every gloo collective costs each rank about 0.7 ms of gloo's TCP thread,
about 0.7 % of the 1m example's sharded step; docs/BENCHMARKS.md.)
"""
from __future__ import annotations

from typing import Callable

import torch


class PauseVote:
    def __init__(self, wants: Callable[[], bool], agreed: Callable[[int], None]):
        """``wants()``: this rank was asked to pause in this generation; ``agreed(step)``: every
        rank pauses once ``step`` is committed."""
        self._wants, self._agreed = wants, agreed

    def flag(self) -> int:
        """This rank's byte of the vote."""
        return 1 if self._wants() else 0

    def judge(self, step: int, flags: torch.Tensor | None) -> None:
        """In the gate of ``step``, every rank's byte gathered: a pause asked anywhere is agreed."""
        if flags is not None and bool(flags.any()):
            self._agreed(step)


__all__ = ["PauseVote"]
