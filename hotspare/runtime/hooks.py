"""The one seam where a testing plug-in acts inside a worker.

Production workers use ``WorkerHooks`` itself, whose methods do nothing. The fault-injection
plug-in (``hotspare.testing.faults.worker``, loaded only when the launcher enabled injection) subclasses
it to report triggers to its agent and to carry out the faults a worker does to itself.
"""
from __future__ import annotations

import torch


class WorkerHooks:
    def step_begins(self, gen: int, rank: int, step: int, total: int | None) -> None:
        """A step begins on this rank (before its entry state is captured)."""

    def joining(self, gen: int, rank: int) -> None:
        """This rank starts joining generation ``gen``."""

    def transfer(self, gen: int, rank: int, role: str) -> None:
        """This rank starts a state transfer as ``role`` (source | receiver | restore)."""

    def reduction_reached(self, compute_s: float) -> None:
        """This step's gradient exchange begins, ``compute_s`` seconds into the step."""

    def bucket(self, flat: torch.Tensor) -> None:
        """A gradient bucket of this rank, before it is scaled and reduced."""
