"""Chaos soak: a seeded random schedule of real faults, judged by the bitwise oracle.

The schedule is a pure function of (seed, steps, faults, world size), so a failing soak can be
rerun exactly. Fault kinds are mixed: a SIGKILL, a hang (SIGSTOP, found by heartbeat and fenced),
an abrupt exit with a status, two ranks killed in the same step, and faults *during* a
recovery (the replacement or the state source killed while the state moves, a survivor killed
while the next generation forms). Every kind keeps at least one in-memory copy of the state, so
the soak must end with the fault-free run's digest, zero lost and zero repeated steps.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

KINDS = ("kill", "hang", "exit", "double", "during-transfer", "during-join")
# With --health: signals the health service acts on (live migration or failover from a replica).
HEALTH_KINDS = ("thermal", "ecc", "corrupt", "nan", "gpu-lost")


@dataclass
class Schedule:
    specs: list[str] = field(default_factory=list)      # --inject specs
    events: list[tuple[int, str]] = field(default_factory=list)   # (step, kind) for the summary

    @property
    def faults(self) -> int:
        return len(self.specs)


def make_schedule(seed: int, steps: int, faults: int, world: int, kinds=KINDS) -> Schedule:
    """``faults`` fault events spread over ``steps`` (some events inject two faults)."""
    if world < 3:
        raise ValueError("chaos needs at least 3 ranks (double faults must leave a survivor)")
    if steps < 4 * (faults + 1):
        raise ValueError(f"{steps} steps are too few for {faults} faults: give at least {4 * (faults + 1)}")
    rng = random.Random(seed)
    gap = steps // (faults + 1)
    sched = Schedule()
    for i in range(faults):
        step = gap * (i + 1) + rng.randrange(-(gap // 3), gap // 3 + 1)
        kind = kinds[i % len(kinds)] if i < len(kinds) else rng.choice(kinds)
        a, b = rng.sample(range(world), 2)
        if kind == "kill":
            sched.specs.append(f"kill:rank={a}:step={step}")
        elif kind == "hang":
            sched.specs.append(f"hang:rank={a}:step={step}")
        elif kind == "exit":
            sched.specs.append(f"exit:rank={a}:step={step}:code={rng.randrange(1, 120)}")
        elif kind == "double":
            sched.specs += [f"kill:rank={a}:step={step}", f"kill:rank={b}:step={step}"]
        elif kind == "during-transfer":   # the replacement of rank a dies while receiving
            sched.specs += [f"kill:rank={a}:step={step}", f"kill:rank={a}:phase=transfer:after={step}"]
        elif kind == "during-join":       # a survivor dies while the next generation forms
            sched.specs += [f"kill:rank={a}:step={step}", f"kill:rank={b}:phase=join:after={step}"]
        elif kind == "thermal":
            sched.specs.append(f"thermal:rank={a}:temp={rng.randrange(91, 99)}:step={step}")
        elif kind == "ecc":
            sched.specs.append(f"ecc:rank={a}:kind=uncorrectable:step={step}")
        elif kind == "corrupt":
            sched.specs.append(f"corrupt:rank={a}:step={step}")
        elif kind == "nan":
            sched.specs.append(f"nan:rank={a}:step={step}")
        elif kind == "gpu-lost":
            sched.specs.append(f"xid:rank={a}:code=79:step={step}")
        sched.events.append((step, kind))
    return sched
