"""What a sharded job's buddy snapshots cost, part by part, on the threads that do the work.

The side-by-side bench (``bench/overhead.py --sharded fsdp``) compares whole jobs; on this 2-core
machine its rounds swing by about as much as the 2 % being measured. This one accounts for the
snapshots' own work directly: the example runs under ``hotspare run --fsdp`` with every rank
wrapped by this file's ``--wrap`` mode, which times, with the CPU clock of the thread doing it
(``time.thread_time_ns``: that thread's CPU only, its system calls included, so other processes
sharing the cores do not inflate it):

* ``gate: snapshot waited``: at the step's gate, the snapshot thread's outcome taken and kept;
* ``gate: log checksummed``: the checksum of the step's gradient shards, sent from their own memory;
* ``gate: log exchanged``: the log to the buddy and the predecessor's in (transfer/links.py);
* ``gate: log kept``: the predecessor's log added to its run;
* ``gate: the rest``: the rest of the gate's buddy work (the gradient shards and the optimizer's
  hyperparameters gathered for the log: ``to_local`` of every DTensor gradient);
* ``snapshot started``: at the step's first forward when one is due (the thread started);
* ``snapshot thread``: the checksum, the exchange and the received one's check, on its thread.

Each part is summed over the steady window (warm-up and the last steps left out) and divided by
its steps, so a snapshot every 8 steps counts an eighth a step; the denominator is the rank's
whole process (every thread) per step over the same window. Mean over the four ranks.

    python bench/snapshot_parts.py                     # 1m example, FSDP over 4 ranks, 100 steps (~1 min)
    python bench/snapshot_parts.py --batch-size 32
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from step_parts import parts_parser      # bench/, this script's folder

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "gpt_stdlib.py"
PARTS = ("gate: snapshot waited", "gate: log checksummed", "gate: log exchanged", "gate: log kept",
         "gate: the rest", "snapshot started", "snapshot thread")


def _wrap_and_run(out_dir: str, warmup: int, script: list[str]) -> None:
    """Inside a rank: time the snapshots' parts, run the script, write the sums."""
    import atexit
    import functools
    import runpy

    import hotspare.runtime.iteration as iteration
    import hotspare.runtime.sharded as sharded
    import hotspare.transfer.buddy as buddy
    import hotspare.transfer.links as links

    clock = time.thread_time_ns
    lock = threading.Lock()
    sums = dict.fromkeys(PARTS, 0)
    marks: list[tuple[int, dict[str, int]]] = []      # (process CPU, the sums) at each step's close
    in_gate = threading.local()

    def add(part: str, ns: int) -> None:
        with lock:
            sums[part] += ns

    def timed(owner, name: str, part, gate_only: bool = False) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if gate_only and not getattr(in_gate, "on", False):
                return fn(*args, **kwargs)
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                add(part(args) if callable(part) else part, clock() - t)
        setattr(owner, name, wrapper)

    gate = sharded.ShardedRuntime._buddy_gate

    inner = ("gate: snapshot waited", "gate: log checksummed", "gate: log exchanged", "gate: log kept")

    def gate_wrapper(self, *args, **kwargs):
        in_gate.on = True
        with lock:
            before = sum(sums[p] for p in inner)
        t = clock()
        try:
            return gate(self, *args, **kwargs)
        finally:
            total = clock() - t
            in_gate.on = False
            with lock:
                sums["gate: the rest"] += total - (sum(sums[p] for p in inner) - before)
    sharded.ShardedRuntime._buddy_gate = gate_wrapper
    timed(buddy.Transfer, "outcome", "gate: snapshot waited", gate_only=True)
    timed(buddy.BuddyStore, "keep_state", "gate: snapshot waited", gate_only=True)
    timed(sharded.wire, "view", "gate: log checksummed", gate_only=True)
    timed(links.Links, "exchange", "gate: log exchanged", gate_only=True)
    timed(buddy.BuddyStore, "add_log", "gate: log kept", gate_only=True)
    timed(sharded.ShardedRuntime, "_start_snapshot", "snapshot started")
    timed(sharded.ShardedRuntime, "_swap_snapshots", "snapshot thread")
    step_exit = iteration.Step.__exit__

    def exit_wrapper(self, *args):
        try:
            return step_exit(self, *args)
        finally:
            with lock:
                marks.append((time.process_time_ns(), dict(sums)))
    iteration.Step.__exit__ = exit_wrapper

    def report() -> None:
        rank = os.environ.get("RANK", "?")
        if len(marks) < warmup + 10:
            return
        (c0, s0), (c1, s1) = marks[warmup], marks[-4]
        n = len(marks) - 4 - warmup
        out = {"rank": rank, "steps": n, "process_us": (c1 - c0) / n / 1000,
               "parts_us": {p: (s1[p] - s0[p]) / n / 1000 for p in PARTS}}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)

    atexit.register(report)
    sys.argv = script
    runpy.run_path(script[0], run_name="__main__")


def _run(model: str, steps: int, warmup: int, batch: int | None) -> list[dict]:
    out_dir = tempfile.mkdtemp(prefix="snapshot-parts-")
    wrapped = [str(Path(__file__).resolve()), "--wrap", out_dir, "--warmup", str(warmup), "--",
               str(EXAMPLE), "--model", model, "--steps", str(steps), "--fsdp",
               *(["--batch-size", str(batch)] if batch else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOTSPARE_LOG_EVERY_S": "0"}
    cmd = [sys.executable, "-m", "hotspare", "run", "--nproc", "4", "--spares", "0", "--", *wrapped]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"hotspare run exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(4)]


def main() -> None:
    p = parts_parser(__doc__, 100, "steps")
    p.add_argument("--batch-size", type=int, help="the example's sequences per rank per step (its default: 8)")
    args = p.parse_args()
    if args.wrap:
        _wrap_and_run(args.wrap, args.warmup, args.script)
        return
    if args.steps < args.warmup + 14:
        p.error(f"--steps must be at least --warmup + 14 = {args.warmup + 14}")
    print(f"model {args.model}, FSDP over 4 ranks, {args.steps} steps, the buddy snapshots' parts per step "
          "(mean over the ranks, amortised over the steady window)", flush=True)
    ranks = _run(args.model, args.steps, args.warmup, args.batch_size)
    print(f"{'part':24s} {'us per step':>12s}")
    total = 0.0
    for part in PARTS:
        v = statistics.mean(r["parts_us"][part] for r in ranks)
        total += v
        print(f"{part:24s} {v:12.1f}")
    proc = statistics.mean(r["process_us"] for r in ranks)
    print(f"the snapshots' parts: {total:.0f} us a step, {100 * total / proc:.2f}% of the rank's process CPU "
          f"per step ({proc / 1000:.1f} ms, every thread)")


if __name__ == "__main__":
    main()
