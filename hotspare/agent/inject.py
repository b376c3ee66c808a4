"""Fault injection with real signals on real processes.

Grammar (one ``--inject`` per fault)::

    KIND:key=value[:key=value...]

    kill:rank=R:step=S       SIGKILL the worker holding rank R when it starts step S

The agent sends SIGKILL to the worker's process the moment that worker reports it has started step S, so the fault lands in
the middle of the step (forward, backward or the gradient exchange), as a real one would.
A fault fires once; the replacement that later runs step S again is left alone.
"""
from __future__ import annotations

import dataclasses
import signal

from hotspare.errors import ConfigError

GRAMMAR = """\
fault injection (--inject, repeatable):
  kill:rank=R:step=S    SIGKILL the process of rank R as soon as it starts step S
                        (step counts from 0; the fault fires once, not on the replacement)
examples:
  --inject kill:rank=2:step=60
  --inject kill:rank=0:step=0 --inject kill:rank=3:step=120"""

KINDS = {"kill": {"rank", "step"}}


@dataclasses.dataclass
class Fault:
    kind: str
    rank: int
    step: int
    fired: bool = False

    @property
    def signal(self) -> signal.Signals:
        return signal.SIGKILL

    def __str__(self) -> str:
        return f"{self.kind}:rank={self.rank}:step={self.step}"


def parse(spec: str, world_size: int | None = None, total_steps: int | None = None) -> Fault:
    """Parse one ``--inject`` spec; raise ConfigError saying what to fix."""
    kind, _, rest = spec.partition(":")
    if kind not in KINDS:
        raise ConfigError(f"--inject {spec!r}: unknown fault kind {kind!r}; known: {', '.join(KINDS)}.\n{GRAMMAR}")
    fields: dict[str, int] = {}
    for part in filter(None, rest.split(":")):
        key, eq, value = part.partition("=")
        if not eq or key not in KINDS[kind]:
            raise ConfigError(f"--inject {spec!r}: bad field {part!r}; {kind} takes "
                              f"{', '.join(sorted(KINDS[kind]))} as key=value.\n{GRAMMAR}")
        try:
            fields[key] = int(value)
        except ValueError:
            raise ConfigError(f"--inject {spec!r}: {key} must be an integer, got {value!r}") from None
        if fields[key] < 0:
            raise ConfigError(f"--inject {spec!r}: {key} must be >= 0")
    missing = KINDS[kind] - set(fields)
    if missing:
        raise ConfigError(f"--inject {spec!r}: missing {', '.join(sorted(missing))}.\n{GRAMMAR}")
    if world_size is not None and fields["rank"] >= world_size:
        raise ConfigError(f"--inject {spec!r}: rank {fields['rank']} does not exist (--nproc {world_size} "
                          f"gives ranks 0..{world_size - 1})")
    if total_steps is not None and fields["step"] >= total_steps:
        raise ConfigError(f"--inject {spec!r}: step {fields['step']} is never reached (the job runs "
                          f"steps 0..{total_steps - 1})")
    return Fault(kind, fields["rank"], fields["step"])


class Injector:
    """Decides, on each step heartbeat, whether a fault fires now."""

    def __init__(self, faults: list[Fault]):
        self.faults = faults

    def due(self, rank: int, step: int) -> Fault | None:
        for f in self.faults:
            if not f.fired and f.rank == rank and f.step == step:
                f.fired = True
                return f
        return None
