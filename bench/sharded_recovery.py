"""Recovery downtime of a sharded job's shard sources, as a ratio to the DDP failover's.

    python bench/sharded_recovery.py                      # tiny example, 3 kills per mode (~8 min on 2 cores)
    python bench/sharded_recovery.py --model 1m --runs 5

Each run is `hotspare run --nproc 4 --spares 1 --inject kill:rank=R:step=S` of
examples/gpt_stdlib.py in one mode: DDP (the replica broadcast), --fsdp (the lost rank's shard
from its buddy: its snapshot of the step before plus that step's gradient log, replayed) and
--hsdp (the shard from its live replica), and --fsdp with a rank *and its buddy* killed in the
same step under `--checkpoint-every 3` (no copy of the lost shard in memory: every rank restores
its own shard from the newest sharded checkpoint; the steps since are lost, and recomputed after
the downtime measured here). The downtime is the report's: from the failure to the next
committed step. Every run must end with the fault-free digest of its mode (checked against a
run without the fault; a sharded checkpoint holds every rank's per-rank row, so the fallback
too ends equal); a run that does not is reported and left out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hotspare.testing import run_job  # noqa: E402

CKPT = "fsdp (checkpoint: a rank and its buddy lost)"
MODES = {"ddp": [], "fsdp (buddy: snapshot + replayed log)": ["--fsdp"], "hsdp (live replica)": ["--hsdp"],
         CKPT: ["--fsdp"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", choices=("tiny", "1m", "5m"))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--runs", type=int, default=3, help="kills per mode")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    base = ["--model", args.model, "--steps", str(args.steps), "--corpus-bytes", "200000"]
    out = {}
    for name, flags in MODES.items():
        ref = run_job([*base, *flags], spares=0)
        if ref.code != 0:
            raise SystemExit(f"{name}: the fault-free run failed:\n{ref.output[-3000:]}")
        downs = []
        for i in range(args.runs):
            rank, step = (1 + i) % 4, args.steps // 2 + i
            if name == CKPT:       # its buddy (rank + 1 on one host) too: the sharded checkpoint
                with tempfile.TemporaryDirectory() as d:
                    r = run_job([*base, *flags], spares=2, inject=[f"kill:rank={rank}:step={step}",
                                                                    f"kill:rank={(rank + 1) % 4}:step={step}"],
                                extra=["--checkpoint-dir", d, "--checkpoint-every", "3"])
            else:
                r = run_job([*base, *flags], inject=[f"kill:rank={rank}:step={step}"])
            f = (r.report or {}).get("failures") or [{}]
            if r.code != 0 or r.digest != ref.digest or f[0].get("downtime_s") is None:
                print(f"   {name}: kill of rank {rank} at step {step}: NOT equal or not recovered; left out", flush=True)
                continue
            downs.append(max(x["downtime_s"] for x in f))
            print(f"   {name}: kill of rank {rank} at step {step}: downtime {downs[-1]:.2f} s, "
                  f"path {f[0].get('recovery_path')}, lost steps {f[0].get('lost_steps')}, "
                  f"phases {json.dumps({k: round(v, 3) for k, v in f[0].get('phases_s', {}).items()})}", flush=True)
        out[name] = {"downtimes_s": downs, "median_s": statistics.median(downs) if downs else None}
    ddp = out["ddp"]["median_s"]
    for name, res in out.items():
        ratio = res["median_s"] / ddp if ddp and res["median_s"] else None
        res["ratio_to_ddp"] = ratio
        print(f"{name:40s} median downtime {res['median_s'] or float('nan'):.2f} s over {len(res['downtimes_s'])} "
              f"kills; ratio to DDP {ratio or float('nan'):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
