"""The seed article's money claim, checked with hotspare plan's closed form.

    python bench/economics_claims.py          # prints the Markdown tables of docs/ECONOMICS.md

Claim (seed.txt): failure-driven restarts "drain more than USD 6 million a year in wasted compute
on a typical 2,048-GPU H200 deployment". Two readings are checked:

- *waste*: what checkpoint-restart loses per year (stalls, recomputed work, restarts);
- *saving*: what live failover gets back net of its spares or lenders (the cheapest of dedicated
  spares, borrowed ones and shrinking).

Both scale linearly with the price of a GPU-hour, so instead of guessing an H200 price the table
gives the price at which each reaches USD 6M; compare it with what your GPU-hour costs.
"""
from __future__ import annotations

from hotspare.sim.economics import PlanInputs, cheapest, evaluate
from hotspare.sim.presets import PRESETS
from hotspare.sim.units import fmt_usd

CLAIM_USD, GPUS, PRICE = 6e6, 2048, 3.0
SETUPS = {
    "tuned (5 s async stall, 10 min restart, Daly interval)": dict(stall=5 / 3600, restart=10 / 60),
    "defaults (2 min stall, 30 min restart, Daly interval)": {},
    "hours behind (2 h interval, 60 min manual restart)": dict(interval=2.0, restart=1.0),
}


def main() -> None:
    print(f"2,048 GPUs, per year; USD at ${PRICE:.2f}/GPU-hour, and the price that makes each reach "
          f"USD {CLAIM_USD / 1e6:.0f}M\n")
    print("| checkpoint setup | failure rate | G ckpt | waste / yr | price for $6M waste | cheapest live "
          "policy | its net saving / yr | price for $6M saving |")
    print("|---|---|---:|---:|---:|---|---:|---:|")
    for setup, change in SETUPS.items():
        for name, preset in PRESETS.items():
            plan = evaluate(PlanInputs(gpus=GPUS, afr=preset.per_gpu_year, price=PRICE, **change))
            waste = plan.checkpoint.wasted_usd_year
            best, saving = cheapest(plan)
            need_saving = f"${CLAIM_USD / saving * PRICE:.2f}" if saving > 0 else "never"
            print(f"| {setup} | {name} ({preset.per_gpu_year:.1%}) | {plan.checkpoint.goodput:.1%} | "
                  f"{fmt_usd(waste)} | ${CLAIM_USD / waste * PRICE:.2f} | {best} | {fmt_usd(saving)} | "
                  f"{need_saving} |")


if __name__ == "__main__":
    main()
