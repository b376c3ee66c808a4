"""Fleet simulator benchmark: speed at Llama-3 scale, and agreement with the closed form.

    python bench/simulator.py            # several minutes on one core (four policies, 300 seeds)
    python bench/simulator.py --quick    # speed and the 30-seed agreement only

Pins itself to one CPU core (where the OS allows) so the timing means "one core". Prints
Markdown tables; docs/BENCHMARKS.md quotes them with the machine they ran on.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from hotspare.sim.fleet import FleetConfig, simulate
from hotspare.sim.presets import PRESETS
from hotspare.sim.validation import CASES, compare


def pin_one_core() -> str:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        return "pinned to one core"
    return "not pinned (no sched_setaffinity here)"


def speed(repeats: int) -> None:
    print("| preset | GPUs | days | seeds | failures / seed | wall time (median of %d) |" % repeats)
    print("|---|---:|---:|---:|---:|---:|")
    for name, preset in PRESETS.items():
        cfg = FleetConfig(gpus=16384, days=30, afr=preset.per_gpu_year)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            result = simulate(cfg, seeds=20, seed=0)
            times.append(time.perf_counter() - start)
        failures = statistics.fmean(r.failures for r in result.checkpoint)
        print(f"| {name} | 16,384 | 30 | 20 | {failures:.0f} | {statistics.median(times):.2f} s |")


def agreement(seeds: int) -> None:
    print(f"| case ({seeds} seeds) | policy | simulated goodput (95% CI) | closed form | within CI |")
    print("|---|---|---:|---:|:---:|")
    for name in CASES:
        for a in compare(name, seeds):
            print(f"| {name} | {a.policy} | {a.simulated:.4%} ± {a.ci:.4%} | {a.closed_form:.4%} | "
                  f"{'yes' if a.within else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="skip the 300-seed agreement run")
    args = parser.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}, {pin_one_core()}\n")
    speed(repeats=5)
    print()
    agreement(30)
    if not args.quick:
        print()
        agreement(300)


if __name__ == "__main__":
    main()
