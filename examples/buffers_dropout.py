"""A model with buffers of its own (a running mean of its hidden activations, updated in every
training forward, and a step counter), dropout, Python's `random` choosing each step's noise
level, and data from a per-rank generator; a rank-0 evaluation every 10 steps between steps.

Run it (CPU, gloo):
    hotspare run --nproc 4 --spares 1 -- examples/buffers_dropout.py --steps 40
    hotspare run --nproc 4 --spares 1 --inject hang:rank=2:step=12 -- examples/buffers_dropout.py --steps 40
    torchrun --nproc-per-node 4 examples/buffers_dropout.py --steps 40

hotspare lines are marked `# hotspare`. The buffers differ from rank to rank (DDP broadcasts rank
0's at each forward, then each rank updates its own): hotspare keeps each rank's.
"""
import argparse
import json
import random

import torch
import torch.nn as nn

import hotspare


class Tracked(nn.Module):
    def __init__(self, dim=48):
        super().__init__()
        self.inp, self.out = nn.Linear(16, dim), nn.Linear(dim, 4)
        self.drop = nn.Dropout(0.3)
        self.register_buffer("act_mean", torch.zeros(dim))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.training:
            with torch.no_grad():
                self.act_mean.mul_(0.9).add_(h.mean(0), alpha=0.1)
                self.seen += 1
        return self.out(self.drop(h - self.act_mean))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stats", help="each rank writes its digests to STATS.rank<R>.json")
    args = p.parse_args()
    torch.set_num_threads(1)

    job = hotspare.init()                                                        # hotspare
    random.seed(args.seed + job.rank)
    torch.manual_seed(args.seed)
    model = job.ddp(Tracked())                                                   # hotspare
    torch.manual_seed(args.seed + 1 + job.rank)           # dropout masks differ per rank
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    stream = torch.Generator().manual_seed(1000 + job.rank)
    job.track(model=model, optimizer=opt, stream=stream)                         # hotspare
    probe = torch.randn(64, 16, generator=torch.Generator().manual_seed(99))

    for step in job.steps(args.steps):                                           # hotspare
        with step:                                                               # hotspare
            x = torch.randn(32, 16, generator=stream)
            y = (x[:, :4] > 0).long().sum(1) % 4
            x = x + random.choice([0.0, 0.1, 0.3]) * torch.randn_like(x)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if job.rank == 0 and step % 10 == 0:
            model.eval()
            with torch.no_grad():
                print(f"step {step}: probe output mean {model.module(probe).mean():.4f}", flush=True)
            model.train()

    if args.stats:
        with open(f"{args.stats}.rank{job.rank}.json", "w") as f:
            json.dump({"digest": job.digest, "rank_digest": job.rank_digest}, f)


if __name__ == "__main__":
    main()
