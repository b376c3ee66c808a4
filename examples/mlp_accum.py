"""An MLP trained with gradient accumulation: several micro-batches per optimizer step, all but
the last under DDP's `no_sync`; `opt.step(); sched.step(); opt.zero_grad()` at the END of the
step (the usual order in accumulation loops); AdamW with a LambdaLR warm-up; each rank draws its
data from its own torch.Generator stream.

Run it (CPU, gloo):
    hotspare run --nproc 4 --spares 1 -- examples/mlp_accum.py --steps 40
    hotspare run --nproc 4 --spares 1 --inject kill:rank=1:step=15 -- examples/mlp_accum.py --steps 40
    torchrun --nproc-per-node 4 examples/mlp_accum.py --steps 40

hotspare lines are marked `# hotspare`. The data generator is per-rank state: job.track() gets it
too, so a replacement continues its predecessor's stream instead of restarting it.
"""
import argparse
import contextlib
import json

import torch
import torch.nn as nn

import hotspare


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--accum", type=int, default=3, help="micro-batches per optimizer step")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps of the learning rate")
    p.add_argument("--set-to-none", type=int, default=1, help="zero_grad(set_to_none=...): 1 or 0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stats", help="each rank writes its digests to STATS.rank<R>.json")
    args = p.parse_args()
    torch.set_num_threads(1)

    job = hotspare.init()                                                        # hotspare
    torch.manual_seed(args.seed)
    model = job.ddp(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),  # hotspare
                                  nn.Linear(64, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    data_gen = torch.Generator().manual_seed(args.seed * 100 + job.rank)         # this rank's data stream
    true_w = torch.randn(32, generator=torch.Generator().manual_seed(12345))
    job.track(model=model, optimizer=opt, scheduler=sched, data=data_gen)        # hotspare
    if job.rank == 0:
        print(f"{sum(p.numel() for p in model.parameters())} parameters, {job.world_size} ranks, "
              f"{args.accum} micro-batches of {args.micro_batch} per step", flush=True)

    for step in job.steps(args.steps):                                           # hotspare
        with step:                                                               # hotspare
            for micro in range(args.accum):
                x = torch.randn(args.micro_batch, 32, generator=data_gen)
                y = (x @ true_w).sin().unsqueeze(1) + 0.05 * torch.randn(args.micro_batch, 1, generator=data_gen)
                last = micro == args.accum - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = nn.functional.mse_loss(model(x), y) / args.accum
                    loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=bool(args.set_to_none))
            job.log(loss=loss.item() * args.accum)

    if job.rank == 0:
        with torch.no_grad():
            x = torch.randn(256, 32, generator=torch.Generator().manual_seed(7))
            print(f"final test loss {nn.functional.mse_loss(model.module(x), (x @ true_w).sin().unsqueeze(1)):.4f}")
    if args.stats:
        with open(f"{args.stats}.rank{job.rank}.json", "w") as f:
            json.dump({"digest": job.digest, "rank_digest": job.rank_digest}, f)


if __name__ == "__main__":
    main()
