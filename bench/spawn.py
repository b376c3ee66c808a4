"""Workers forked from the zygote against workers started as fresh interpreters, in one run.

    python bench/spawn.py                    # tiny model, 4 ranks + 1 spare, 3 rounds (~2 min)
    python bench/spawn.py --rounds 5 --model 1m

Each round runs the same job twice, ``hotspare run --spawn fork`` and ``--spawn exec`` (the order
alternates from round to round): a rank is SIGKILLed, then a second one soon after, which finds
a warm spare only if the replacement of the first one's spare is already up. Measured per job:
the time from the launch to the first step, the whole job's wall time, the CPU time of all its
processes (launcher, zygote, workers: ``RUSAGE_CHILDREN``), and the second failure's downtime
and whether a warm spare was ready for it. Both must end with the same final digest.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "gpt_stdlib.py"
FIRST_STEP = re.compile(r"^\[hotspare\s+([\d.]+)s\] step\s+0/")


def run(mode: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "hotspare", "run", "--nproc", str(args.nproc), "--spares", "1",
               "--spawn", mode, "--report", report,
               "--inject", f"kill:rank=1:step={args.steps // 4}",
               "--inject", f"kill:rank=2:step={args.steps // 4 + args.gap}",
               "--", str(EXAMPLE), "--model", args.model, "--steps", str(args.steps)]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            sys.exit(f"bench/spawn.py: the {mode} job failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
        rep = json.load(open(report))
    first = next((float(m.group(1)) for m in map(FIRST_STEP.match, proc.stdout.splitlines()) if m), float("nan"))
    second = rep["failures"][-1]
    return {"first_step_s": first, "wall_s": wall,
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "downtime2_s": second["downtime_s"], "warm2": second["spare_was_warm"],
            "digest": rep["final_state_digest"], "failures": rep["failures_total"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="tiny", help="example preset: tiny, 1m, 5m (default: tiny)")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--gap", type=int, default=10, help="steps between the two kills (default: 10)")
    p.add_argument("--nproc", type=int, default=4)
    args = p.parse_args()
    if args.rounds < 1 or args.steps < 8 or args.gap < 1 or args.steps // 4 + args.gap >= args.steps:
        p.error("need --rounds >= 1, --steps >= 8 and the second kill (steps/4 + gap) before the last step")

    rows = {"fork": [], "exec": []}
    for r in range(args.rounds):
        order = ("fork", "exec") if r % 2 == 0 else ("exec", "fork")
        for mode in order:
            res = run(mode, args)
            rows[mode].append(res)
            print(f"round {r + 1}/{args.rounds} {mode:4s}: first step {res['first_step_s']:5.2f} s, "
                  f"job {res['wall_s']:5.1f} s, CPU {res['cpu_s']:5.1f} s, second failure: downtime "
                  f"{res['downtime2_s']:.2f} s, warm spare {'yes' if res['warm2'] else 'no'}", flush=True)
    digests = {res["digest"] for mode in rows for res in rows[mode]}
    if len(digests) != 1:
        sys.exit(f"bench/spawn.py: the final digests differ: {sorted(digests)}")

    def med(mode, key):
        return statistics.median(res[key] for res in rows[mode])

    print(f"\nmedians over {args.rounds} round(s), {args.nproc} ranks + 1 spare, --model {args.model}, "
          f"two kills {args.gap} steps apart; one final digest {digests.pop()[:16]}")
    print(f"{'':24s}{'fork':>9s}{'exec':>9s}{'fork/exec':>11s}")
    for key, label in (("first_step_s", "launch to first step s"), ("wall_s", "job wall time s"),
                       ("cpu_s", "job CPU time s"), ("downtime2_s", "2nd failure downtime s")):
        f, e = med("fork", key), med("exec", key)
        print(f"{label:24s}{f:9.2f}{e:9.2f}{f / e:11.3f}")
    for mode in ("fork", "exec"):
        warm = sum(res["warm2"] for res in rows[mode])
        print(f"{mode}: the second failure found a warm spare in {warm}/{args.rounds} round(s)")


if __name__ == "__main__":
    main()
