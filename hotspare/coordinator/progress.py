"""The current generation's progress as the coordinator sees it: what the hang detector and
the stall clock read, reset each time a generation forms (coordinator thread only)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Progress:
    at: float                                  # last commit, or the current generation forming
    joined: set[int] = field(default_factory=set)          # ranks that finished joining this generation
    committed: bool = False                    # this generation committed a step
    reducing: dict[int, int] = field(default_factory=dict)  # rank -> last step whose exchange it entered
    restoring: str | None = None               # the checkpoint this generation restores, until it commits
    recovering_since: float | None = None
    probed_at: float = 0.0                     # when the ranks were last asked where they are

    def formed(self, now: float, restore: str | None) -> None:
        self.at = now
        self.reducing, self.joined, self.committed = {}, set(), False
        self.restoring = restore

    def rank_joined(self, rank: int, t: float) -> None:
        self.joined.add(rank)
        self.at = max(self.at, t)              # the stall clock starts once joined

    def step_committed(self, t: float) -> None:
        self.at = max(self.at, t)
        self.committed = True
        self.restoring = None
