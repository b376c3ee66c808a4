"""What one rank keeps across steps and generations, built once per process and passed whole
to the parts that need it (``StepProtocol``, ``Membership``, ``StateSync``, the loop's top)."""
from __future__ import annotations

import dataclasses
from typing import Any

from hotspare.runtime.failures import Collectives
from hotspare.runtime.hooks import WorkerHooks
from hotspare.runtime.rankstate import GradState, RankState, RowTable
from hotspare.runtime.state import StateRegistry


@dataclasses.dataclass
class Progress:
    committed: int = -1      # last committed step on this rank
    applied: int = -1        # last step whose optimizer update is in the state


@dataclasses.dataclass
class RankContext:
    """The rank's state and bookkeeping: the replicated registry, the per-rank state and its
    rows (every rank's, gathered at each exchange), which gradients exist, the resumable
    loaders, where this step's communication failed, and the testing plug-in's hooks."""
    registry: StateRegistry
    rankstate: RankState
    grads: GradState
    rows: RowTable
    progress: Progress
    collectives: Collectives
    hooks: WorkerHooks
    loaders: list[Any] = dataclasses.field(default_factory=list)   # runtime/loader.py ResumableLoader

    @classmethod
    def new(cls) -> "RankContext":
        rankstate = RankState()
        return cls(registry=StateRegistry(), rankstate=rankstate, grads=GradState(), rows=RowTable(rankstate),
                   progress=Progress(), collectives=Collectives(), hooks=WorkerHooks())

    @property
    def committed(self) -> int:
        return self.progress.committed
