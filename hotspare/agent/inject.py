"""Fault injection with real signals on real processes.

Grammar (one ``--inject`` per fault)::

    KIND:key=value[:key=value...]

A fault fires once: the replacement that later runs the same step is left alone. Triggers are
the worker's own heartbeats, acted on by the agent the moment they arrive, so a fault lands in
the middle of the step (forward, backward or the gradient exchange) or the recovery phase, as a
real one would.
"""
from __future__ import annotations

import dataclasses
import signal

from hotspare.errors import ConfigError

GRAMMAR = """\
fault injection (--inject, repeatable; steps count from 0; each fault fires once):
  kill:rank=R:step=S          SIGKILL the process of rank R as soon as it starts step S
  hang:rank=R:step=S          SIGSTOP it instead: a hang, found by heartbeat and fenced
  exit:rank=R:step=S[:code=C] the worker exits abruptly with status C (default 1), as a
                              crashing library would (its control thread calls os._exit)
  kill:rank=R:phase=join      SIGKILL rank R when it starts joining a new generation
  kill:rank=R:phase=transfer  SIGKILL rank R when it starts sending or receiving state
                              (phase faults fire during recoveries, generation 2 and later,
                              unless :gen=G names the generation; :after=S arms one only
                              once some rank has started step S)
examples:
  --inject kill:rank=2:step=60
  --inject hang:rank=1:step=30 --inject exit:rank=3:step=80:code=7
  --inject kill:rank=0:step=10 --inject kill:rank=1:phase=transfer"""

KINDS = ("kill", "hang", "exit")
PHASES = ("join", "transfer")
_KEYS = {"rank", "step", "code", "phase", "gen", "after"}


@dataclasses.dataclass
class Fault:
    kind: str
    rank: int
    step: int | None = None
    phase: str | None = None
    gen: int | None = None
    code: int = 1
    after: int = 0
    fired: bool = False

    @property
    def signal(self) -> signal.Signals | None:
        return {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}.get(self.kind)

    def __str__(self) -> str:
        where = f"step={self.step}" if self.phase is None else f"phase={self.phase}"
        extra = f":code={self.code}" if self.kind == "exit" else ""
        extra += f":gen={self.gen}" if self.gen is not None else ""
        extra += f":after={self.after}" if self.after else ""
        return f"{self.kind}:rank={self.rank}:{where}{extra}"


def parse(spec: str, world_size: int | None = None) -> Fault:
    """Parse one ``--inject`` spec; raise ConfigError saying what to fix."""
    kind, _, rest = spec.partition(":")
    if kind not in KINDS:
        raise ConfigError(f"--inject {spec!r}: unknown fault kind {kind!r}; known: {', '.join(KINDS)}.\n{GRAMMAR}")
    fields: dict[str, str] = {}
    for part in filter(None, rest.split(":")):
        key, eq, value = part.partition("=")
        if not eq or key not in _KEYS:
            raise ConfigError(f"--inject {spec!r}: bad field {part!r}; use key=value with keys "
                              f"{', '.join(sorted(_KEYS))}.\n{GRAMMAR}")
        fields[key] = value
    ints: dict[str, int] = {}
    for key in ("rank", "step", "code", "gen", "after"):
        if key in fields:
            try:
                ints[key] = int(fields[key])
            except ValueError:
                raise ConfigError(f"--inject {spec!r}: {key} must be an integer, got {fields[key]!r}") from None
            if ints[key] < 0:
                raise ConfigError(f"--inject {spec!r}: {key} must be >= 0")
    phase = fields.get("phase")
    if "rank" not in ints:
        raise ConfigError(f"--inject {spec!r}: missing rank.\n{GRAMMAR}")
    if phase is None and "step" not in ints:
        raise ConfigError(f"--inject {spec!r}: missing step (or phase=join|transfer).\n{GRAMMAR}")
    if phase is not None:
        if phase not in PHASES:
            raise ConfigError(f"--inject {spec!r}: phase must be one of {', '.join(PHASES)}")
        if kind != "kill" or "step" in ints:
            raise ConfigError(f"--inject {spec!r}: phase= goes with kill and without step=")
    elif "after" in ints or "gen" in ints:
        raise ConfigError(f"--inject {spec!r}: after= and gen= only go with phase=")
    if "code" in ints and kind != "exit":
        raise ConfigError(f"--inject {spec!r}: code= only goes with exit")
    if world_size is not None and ints["rank"] >= world_size:
        raise ConfigError(f"--inject {spec!r}: rank {ints['rank']} does not exist (--nproc {world_size} "
                          f"gives ranks 0..{world_size - 1})")
    return Fault(kind, ints["rank"], ints.get("step"), phase, ints.get("gen"), ints.get("code", 1),
                 ints.get("after", 0))


class Injector:
    """Decides, on each heartbeat, whether a fault fires now."""

    def __init__(self, faults: list[Fault]):
        self.faults = faults
        self.max_step = -1            # the newest step any rank has started

    def at_step(self, rank: int, step: int) -> Fault | None:
        self.max_step = max(self.max_step, step)
        return self._take(lambda f: f.phase is None and f.rank == rank and f.step == step)

    def at_phase(self, rank: int, phase: str, gen: int) -> Fault | None:
        return self._take(lambda f: f.phase == phase and f.rank == rank and self.max_step >= f.after
                          and (gen == f.gen if f.gen is not None else gen >= 2))

    def _take(self, match) -> Fault | None:
        for f in self.faults:
            if not f.fired and match(f):
                f.fired = True
                return f
        return None
