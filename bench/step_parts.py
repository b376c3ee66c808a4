"""Where hotspare's extra work on a worker's training thread goes, part by part, against torchrun.

The steady-state bench (bench/overhead.py) measures the whole job; on a 2-core machine its
rounds swing by more than the fixed cost being measured. This one accounts for the training
thread alone: the example runs once under ``hotspare run`` and once under plain ``torchrun``
(the same script: under torchrun hotspare's API runs unmanaged), each rank wrapped by this
file's ``--wrap`` mode, which times hotspare's entry points on the training thread with the
thread's own CPU clock (``time.thread_time_ns``: only this thread's CPU, not wall time, so
other processes sharing the cores do not inflate it), nested calls counted once:

* ``steps() next``: the top of each iteration of ``job.steps`` (recovering a failed step, the
  per-rank state captured and compared with the last commit's, published when it changed);
* ``Step.__enter__`` / ``Step.__exit__``: the step block's entry (what a re-run starts from) and
  close (the vote judged, the rows closed, the commit reported);
* ``DDP hook``: hotspare's gradient-bucket hook (scale and NaN scan in one pass, the all-reduce
  issued, this rank's row written to the store before its first bucket) — under torchrun DDP's
  own C++ hook does the scaling and the all-reduce instead, outside Python, so this row has no
  torchrun counterpart to subtract;
* ``reduction waited``: the wait for the buckets and the step's verdict, run from DDP's
  end-of-backward callback (blocked time is not CPU);
* ``before/after optimizer step``: the optimizer hooks;
* ``seed_step``: the script's per-step generator (the same function under both).

Per part: the median per step over the steps after warm-up (each rank's last steps left out: the
job's end is not a step). Rank 1's figures are printed (rank 0 also reports every commit).

    python bench/step_parts.py                       # 1m example, 150 steps each (~1 min)
    python bench/step_parts.py --model 5m --steps 80
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "gpt_stdlib.py"
PARTS = ("steps() next", "Step.__enter__", "Step.__exit__", "DDP hook", "reduction waited",
         "before optimizer step", "after optimizer step", "seed_step")
# inside the parts above, timed on their own too (not added to the total)
INSIDE = ("  per-rank state captured", "  rows closed", "  commit reported", "  row captured and stored")


def _wrap_and_run(out_dir: str, warmup: int, script: list[str]) -> None:
    """Inside a rank: time hotspare's entry points, run the script, write the medians."""
    import atexit
    import functools
    import runpy

    import hotspare
    import hotspare.runtime.ddp as ddp
    import hotspare.runtime.iteration as iteration
    import hotspare.runtime.job as job_module
    import hotspare.runtime.rankstate as rankstate
    import hotspare.runtime.steps as steps

    clock = time.thread_time_ns
    per_step: dict[str, list[int]] = {p: [] for p in PARTS + INSIDE}
    current: dict[str, int] = dict.fromkeys(PARTS + INSIDE, 0)
    depth = [0]
    stamps: list[int] = []      # the thread's CPU clock at each step's close

    def close_step() -> None:
        stamps.append(clock())
        for p in PARTS + INSIDE:
            per_step[p].append(current[p])
            current[p] = 0

    def timed(owner, name: str, part: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)
            depth[0] += 1
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                current[part] += clock() - t
                depth[0] -= 1
                if part == "Step.__exit__":
                    close_step()
        setattr(owner, name, wrapper)

    def inside(owner, name: str, part: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                current[part] += clock() - t
        setattr(owner, name, wrapper)

    inside(rankstate.RankState, "capture", "  per-rank state captured")
    inside(rankstate.RowTable, "close", "  rows closed")
    inside(steps.StepProtocol, "_report_commit", "  commit reported")
    inside(rankstate.RowTable, "begin", "  row captured and stored")
    timed(iteration.Step, "__enter__", "Step.__enter__")
    timed(iteration.Step, "__exit__", "Step.__exit__")
    timed(ddp, "_allreduce_hook", "DDP hook")
    timed(steps.StepProtocol, "finish_reduction", "reduction waited")
    timed(steps.StepProtocol, "before_optimizer_step", "before optimizer step")
    timed(steps.StepProtocol, "after_optimizer_step", "after optimizer step")
    timed(hotspare, "seed_step", "seed_step")
    original_steps = job_module.Job.steps

    def steps_timed(self, *args, **kwargs):
        gen = original_steps(self, *args, **kwargs)
        while True:
            t = clock()
            try:
                value = next(gen)
            except StopIteration:
                return
            finally:
                current["steps() next"] += clock() - t
            yield value

    job_module.Job.steps = steps_timed

    def report() -> None:
        rank = os.environ.get("RANK", "?")
        measured = {p: v[warmup:-3] for p, v in per_step.items()}
        n = len(measured["Step.__exit__"])
        if n < 5:
            return
        out = {"rank": rank, "steps": n,
               "main_thread_us": statistics.median(b - a for a, b in zip(stamps[warmup:-3], stamps[warmup + 1:-3])) / 1000,
               "parts_us": {p: statistics.median(v) / 1000 for p, v in measured.items()}}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)

    atexit.register(report)
    sys.argv = script
    runpy.run_path(script[0], run_name="__main__")


def _run(kind: str, model: str, steps: int, warmup: int) -> dict:
    out_dir = tempfile.mkdtemp(prefix=f"step-parts-{kind}-")
    wrapped = [str(Path(__file__).resolve()), "--wrap", out_dir, "--warmup", str(warmup), "--",
               str(EXAMPLE), "--model", model, "--steps", str(steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "HOTSPARE_LOG_EVERY_S": "0"}
    if kind == "hotspare":
        cmd = [sys.executable, "-m", "hotspare", "run", "--nproc", "4", "--spares", "0", "--", *wrapped]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", *wrapped]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out_dir, "rank1.json")) as f:
        return json.load(f)


def parts_parser(doc: str, steps: int, steps_help: str) -> argparse.ArgumentParser:
    """The command line of the part-by-part benches (this one and bench/snapshot_parts.py): the
    example's preset, its steps and warm-up, and the hidden ``--wrap`` mode each rank runs in."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1m", choices=["tiny", "1m", "5m"], help="example preset (default: 1m)")
    p.add_argument("--steps", type=int, default=steps, help=f"{steps_help} (default: {steps})")
    p.add_argument("--warmup", type=int, default=20, help="steps left out at the start (default: 20)")
    p.add_argument("--wrap", help=argparse.SUPPRESS)
    p.add_argument("script", nargs="*", help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = parts_parser(__doc__, 150, "steps per job").parse_args()
    if args.wrap:
        _wrap_and_run(args.wrap, args.warmup, args.script)
        return
    print(f"model {args.model}, {args.steps} steps, rank 1's training thread, CPU per step (median), "
          "hotspare run then torchrun", flush=True)
    res = {k: _run(k, args.model, args.steps, args.warmup) for k in ("hotspare", "torchrun")}
    h, t = res["hotspare"], res["torchrun"]
    print(f"{'part':24s} {'hotspare us':>12s} {'torchrun us':>12s} {'extra us':>10s}")
    extra = 0.0
    for part in PARTS:
        a, b = h["parts_us"][part], t["parts_us"][part]
        if part != "DDP hook":
            extra += a - b
        print(f"{part:24s} {a:12.1f} {b:12.1f} {a - b:10.1f}")
    for part in INSIDE:
        print(f"{part:24s} {h['parts_us'][part]:12.1f}")
    base = t["main_thread_us"]
    print(f"training thread per step: hotspare {h['main_thread_us']:.0f} us, torchrun {base:.0f} us "
          f"(ratio {h['main_thread_us'] / base:.4f})")
    print(f"hotspare's parts beyond torchrun's, the DDP hook left out: {extra:.0f} us a step, "
          f"{100 * extra / base:.2f}% of torchrun's training thread")


if __name__ == "__main__":
    main()
