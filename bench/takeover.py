"""What a spare's take-over costs now that spares wait inside hotspare.init(), against the
design before it (spares ran the script's set-up — model, optimizer, data — before they were
needed, with rank None and a world of one), in one run, side by side.

    python bench/takeover.py                       # 5M GPT example, 3 rounds (~4 min)
    python bench/takeover.py --model 1m --rounds 5
    python bench/takeover.py --baseline 5c2683f    # the design to compare against (a git revision)

Each round runs the same job with the checkout's code and with the baseline's (checked out into
a temporary git worktree; the order alternates): 4 ranks + 1 warm spare, rank 2 SIGKILLed at a
given step. Measured per job, from the report: the failure's downtime (detection to the first
committed step after it) and its phases. The spare's set-up after init() now runs inside
"transfer_state" (the source waits for the replacement to build what it receives into).
Both must end with the same final digest.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(tree: Path, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "hotspare", "run", "--nproc", "4", "--spares", "1", "--report", report,
               "--inject", f"kill:rank=2:step={args.kill_at}",
               "--", str(tree / "examples" / "gpt_stdlib.py"), "--model", args.model, "--steps", str(args.steps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
        if proc.returncode != 0:
            sys.exit(f"bench/takeover.py: the job in {tree} failed (exit {proc.returncode}):\n"
                     f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        rep = json.load(open(report))
    f = rep["failures"][0]
    return {"downtime_s": f["downtime_s"], "phases": f["phases_s"], "digest": rep["final_state_digest"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="5m", help="example preset: tiny, 1m, 5m (default: 5m)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-at", type=int, default=30)
    p.add_argument("--baseline", default="5c2683f", help="git revision of the design to compare against")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), args.baseline],
                       check=True, capture_output=True)
        try:
            results: dict[str, list[dict]] = {"now": [], "baseline": []}
            for i in range(args.rounds):
                order = [("now", REPO), ("baseline", base)]
                for name, tree in (order if i % 2 == 0 else order[::-1]):
                    res = run(tree, args)
                    results[name].append(res)
                    print(f"round {i + 1} {name:>8}: downtime {res['downtime_s']:.2f} s  "
                          + "  ".join(f"{k} {v:.2f}" for k, v in res["phases"].items()), flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], capture_output=True)
    now = statistics.median(r["downtime_s"] for r in results["now"])
    old = statistics.median(r["downtime_s"] for r in results["baseline"])
    digests = {r["digest"] for rs in results.values() for r in rs}
    print(f"\nmedian downtime: spares wait in init() {now:.2f} s, spares pre-built (baseline {args.baseline}) "
          f"{old:.2f} s, ratio {now / old:.2f}")
    for phase in results["now"][0]["phases"]:
        a = statistics.median(r["phases"][phase] for r in results["now"])
        b = statistics.median(r["phases"][phase] for r in results["baseline"])
        print(f"  {phase:>22}: {a:.3f} s vs {b:.3f} s")
    print("final digests equal:", len(digests) == 1)


if __name__ == "__main__":
    main()
