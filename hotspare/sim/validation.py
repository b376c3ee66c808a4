"""Simulator vs. closed form, on the cases where the closed form is exact.

The closed form assumes one detection latency, no rack-wide events and a pool that never runs
dry; these cases meet those assumptions and span rare to very frequent failures (job MTBF from
three days down to 32 minutes), so agreement here checks both the simulator's bookkeeping and
the renewal algebra of ``failure_math``. Shared by the test suite and ``bench/simulator.py``.

The same cases check the policies of ``pool``: borrowing (lendable work as large as the job, so
it never runs out) and shrinking. For shrinking the closed form is an approximation: it runs the
renewal form at the *mean* speed (the Poisson share of copies in repair, averaged over a run that
starts with none), where the simulator slows the job's clock copy by copy as failures and repairs
happen.
"""
from __future__ import annotations

import dataclasses

from hotspare.sim.fleet import FleetConfig, simulate
from hotspare.sim.presets import PRESETS, FailureKind


POLICIES = ("checkpoint", "hotspare", "borrow", "shrink")


def one_kind(detect_h: float = 0.0, destroys: float = 0.0) -> tuple[FailureKind, ...]:
    return (FailureKind("any", 1.0, detect_h, 24.0, 0.0, destroys, "validation"),)


PLENTY = 100_000   # spares: nobody ever waits for a cold node
LENDABLE = 1.0     # lendable work as large as the job: nobody waits for a lender either

CASES: dict[str, FleetConfig] = {
    "llama3 rate, 16k GPUs, 30 d": FleetConfig(
        gpus=16384, days=30, afr=PRESETS["llama3-405b"].per_gpu_year, mix=one_kind(destroys=0.05),
        spares=PLENTY, lendable_share=LENDABLE),
    "rsc1 rate, 2k GPUs, 1 y, tau 2h, R 45m": FleetConfig(
        gpus=2048, days=365, afr=PRESETS["meta-rsc1"].per_gpu_year,
        mix=one_kind(detect_h=30 / 3600, destroys=0.05), interval=2.0, restart=0.75, spares=PLENTY,
        lendable_share=LENDABLE),
    "slow checkpoints, 20% fallback": FleetConfig(
        gpus=1024, days=365, afr=0.5, mix=one_kind(destroys=0.2), stall=0.1, restart=1.0,
        downtime=0.25, replica_nodes=1, spares=PLENTY, lendable_share=LENDABLE),
    "no fallbacks, 8k GPUs": FleetConfig(
        gpus=8192, days=60, afr=0.3, mix=one_kind(detect_h=60 / 3600), hotspare_interval=6.0,
        spares=PLENTY, lendable_share=LENDABLE),
    "MTBF 32 min, 16k GPUs": FleetConfig(
        gpus=16384, days=30, afr=1.0, mix=one_kind(destroys=0.1), restart=1.0, downtime=0.2,
        overhead=0.03, spares=PLENTY, lendable_share=LENDABLE),
}


@dataclasses.dataclass(frozen=True)
class Agreement:
    case: str
    policy: str
    simulated: float
    ci: float          # 95% half-width over seeds
    closed_form: float

    @property
    def within(self) -> bool:
        return abs(self.simulated - self.closed_form) <= self.ci


def closed_form(plan, policy: str) -> float:
    return {"checkpoint": lambda: plan.checkpoint.goodput, "hotspare": lambda: plan.hotspare.goodput,
            "borrow": lambda: plan.borrowed.outcome.goodput,
            "shrink": lambda: plan.shrunk.outcome.goodput}[policy]()


def compare(name: str, seeds: int, seed: int = 0) -> list[Agreement]:
    result = simulate(CASES[name], seeds, seed)
    summary = result.summary()
    return [Agreement(name, policy, summary[policy]["goodput"]["mean"], summary[policy]["goodput"]["ci"],
                      closed_form(result.plan, policy))
            for policy in POLICIES if policy in summary]
