"""The live-migration pause of a sharded job, carried by its step gate.

A DDP job's pause rides on the health vote (runtime/healthvote.py), which also compares the
replicas' parameter fingerprints: a sharded job's ranks hold different shards, so it has no such
vote. Here each rank contributes one row, ``[0, 0, 0, 0, I was asked to pause]`` (runtime/vote.py
``row``), to a tiny asynchronous all-reduce on the generation's group, started as the step's
first forward begins (it runs while forward and backward compute) and judged in the sharded
step gate, before any optimizer steps (runtime/sharded.py). A pause agreed there makes every
rank leave once this same step is committed, as a DDP job's vote does; the migrating rank then
hands its own state, its shards included, to the spare (runtime/membership.py ``handoff``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from hotspare.runtime.vote import row, tally


class PauseVote:
    def __init__(self, wants: Callable[[], bool], agreed: Callable[[int], None]):
        """``wants()``: this rank was asked to pause in this generation; ``agreed(step)``: every
        rank pauses once ``step`` is committed."""
        self._wants, self._agreed = wants, agreed
        self._inflight: tuple[int, Any, torch.Tensor] | None = None    # (step, work, table)

    def start(self, step: int, group: Any, world: int, rank: int) -> None:
        """Launch this step's vote (once per step) on ``group`` (a GenerationGroup)."""
        if self._inflight is not None and self._inflight[0] == step:
            return
        table = row(world, rank, 0, self._wants())       # float32, like DDP's (see vote.row)
        self._inflight = (step, group.allreduce(table), table)

    def judge(self, step: int) -> None:
        """In the gate: wait for the vote of ``step``; a pause asked anywhere is agreed."""
        inflight, self._inflight = self._inflight, None
        if inflight is None or inflight[0] != step:
            return
        _, work, table = inflight
        work.wait()
        if tally(table, step, with_fingerprint=False).pause:
            self._agreed(step)

    def drop(self) -> None:
        """The generation failed: the vote in flight is abandoned with it."""
        self._inflight = None


__all__ = ["PauseVote"]
