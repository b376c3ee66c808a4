"""The structured event schema shared by logs, reports and (later) the dashboard and simulator.

Every event names where it happened (job, host, device, rank, step, generation), what it was
(``kind``) and why hotspare acted (``reason``). Keep this module free of other hotspare imports.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any


@dataclasses.dataclass
class Event:
    kind: str                      # e.g. "failure", "recovered", "generation", "spare_started", "stop"
    reason: str = ""
    job: str = ""
    host: str = ""
    device: str = ""
    rank: int | None = None
    step: int | None = None
    generation: int | None = None
    time: float = dataclasses.field(default_factory=time.time)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if v not in (None, "", {})}
