"""What one gradient reduction costs the worker beyond plain DDP, pass by pass (one process).

    python bench/passes.py                 # the 5M example's gradients (4.9M floats), 150 rounds
    python bench/passes.py --model 1m

Plain DDP copies each gradient into its bucket and scales it by 1/world in the same pass
(``mul_out``). Under a comm hook DDP only copies (``copy_``), and the hook scales the bucket
itself: that is the pass hotspare's reduction pays for, and its NaN/Inf check rides on it. Each
variant below runs the bucket work of one step; the variants are interleaved round by round, so
drift hits all of them alike, and the median CPU time (thread time) is reported next to plain
DDP's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

from gpt_stdlib import GPT, PRESETS  # noqa: E402

from hotspare.runtime.vote import scale_and_check  # noqa: E402

WORLD = 4


def variants(grads: list[torch.Tensor]) -> dict:
    bucket = torch.empty(sum(g.numel() for g in grads))
    views, at = [], 0
    for g in grads:
        views.append(bucket[at:at + g.numel()].view_as(g))
        at += g.numel()
    found = torch.zeros(1)

    def copy_in():
        for v, g in zip(views, grads):
            v.copy_(g)

    def plain_ddp():                     # DDP without a hook: copy and scale in one pass
        for v, g in zip(views, grads):
            torch.mul(g, 1.0 / WORLD, out=v)

    def hook_mul_only():                 # a hook that only scales (no NaN check)
        copy_in()
        bucket.mul_(1.0 / WORLD)

    def hook_mul_then_sum():             # hotspare before: scale, then sum 1 MB chunks in cache
        copy_in()
        sums = []
        for start in range(0, bucket.numel(), 1 << 18):
            part = bucket[start:start + (1 << 18)]
            part.mul_(1.0 / WORLD)
            sums.append(part.sum())
        bool(torch.isfinite(torch.stack(sums).sum()))

    def hook_fused_check():              # hotspare now: vote.scale_and_check, one fused pass
        copy_in()
        found.zero_()
        scale_and_check(bucket, 1.0 / WORLD, found)

    return {"plain DDP (mul_out)": plain_ddp, "hook: multiply only": hook_mul_only,
            "hook: multiply, then sum (before)": hook_mul_then_sum,
            "hook: fused scale + check (now)": hook_fused_check}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="5m", choices=sorted(PRESETS))
    p.add_argument("--rounds", type=int, default=150)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    grads = [torch.randn_like(q) for q in GPT(*PRESETS[args.model]).parameters()]
    fs = variants(grads)
    times: dict[str, list[float]] = {k: [] for k in fs}
    for _ in range(args.rounds):
        for name, f in fs.items():
            t0 = time.thread_time()
            f()
            times[name].append(time.thread_time() - t0)
    n = sum(g.numel() for g in grads)
    print(f"{args.model}: {n / 1e6:.2f}M gradient floats ({4 * n / 1e6:.1f} MB), median of {args.rounds} rounds")
    base = statistics.median(times["plain DDP (mul_out)"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"   {name:36s} {1000 * med:7.3f} ms   beyond plain DDP {1000 * (med - base):+7.3f} ms")


if __name__ == "__main__":
    main()
