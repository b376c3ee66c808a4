"""An elastic job's downtime when it shrinks (no spare) against a warm-spare failover, side by side.

Both runs are the same elastic job (tests/scripts/elastic.py over ``job.virtual_ranks``,
``hotspare run --elastic 1``, 2 ranks, 50 ms of sleep per step) with rank 1 SIGKILLed as step 5
begins, through the in-process harness (hotspare/testing/inproc.py), interleaved round by round.
``shrink``: no spare, the survivor takes the lost rank's virtual rank from the rows it already
holds (no state moves); ``spare``: a warm spare takes the rank and receives the state. The
downtime is the report's (the failure's detection to the next committed step). Both runs end
with the same final digest (checked: that of the fault-free elastic run).

    python bench/shrink.py               # 3 rounds
    python bench/shrink.py --rounds 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from hotspare.testing.inproc import run_inproc  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "scripts", "elastic.py")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    x, kill = ["--elastic", "1"], ["kill:rank=1:step=5"]
    shrink, spare = [], []
    for i in range(args.rounds):
        a = run_inproc(["30", "0.05"], nproc=2, spares=0, script=SCRIPT, extra=x, inject=kill)
        b = run_inproc(["30", "0.05"], nproc=2, spares=1, script=SCRIPT, extra=x, inject=kill)
        if a.code or b.code or a.digest != b.digest:
            print(a.output[-3000:], b.output[-3000:])
            return 1
        shrink.append(a.report["failures"][0]["downtime_s"])
        spare.append(b.report["failures"][0]["downtime_s"])
        print(f"round {i}: downtime shrink {shrink[-1]:.3f} s, spare {spare[-1]:.3f} s (same final digest)")
    s, w = statistics.median(shrink), statistics.median(spare)
    print(f"median downtime: shrink {s:.3f} s, warm spare {w:.3f} s; shrink / spare = {s / w:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
