"""A small character model trained with bf16 autocast and a GradScaler on the Python standard
library's own source, read through a DataLoader of text windows with a DistributedSampler;
`zero_grad(set_to_none=False)` at the start of each step and a StepLR schedule. The loop is
flat: `next(loader)` runs through epochs by itself.

Run it (CPU, gloo):
    hotspare run --nproc 4 --spares 1 -- examples/amp_text.py --steps 40
    hotspare run --nproc 4 --spares 1 --inject kill:rank=3:step=0 -- examples/amp_text.py --steps 40
    torchrun --nproc-per-node 4 examples/amp_text.py --steps 40

hotspare lines are marked `# hotspare`; the scaler is tracked like the optimizer.
"""
import argparse
import glob
import json
import os
import sysconfig

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import hotspare


class Windows(Dataset):
    def __init__(self, data, block):
        self.data, self.block = data, block

    def __len__(self):
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i):
        chunk = self.data[i * self.block:(i + 1) * self.block + 1]
        return chunk[:-1], chunk[1:]


class CharModel(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.emb = nn.Embedding(256, dim)
        self.mix = nn.Sequential(nn.Linear(2 * dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 256)

    def forward(self, idx):
        x = self.emb(idx)
        prev = F.pad(x, (0, 0, 1, 0))[:, :-1]            # the character before, as context
        return self.head(self.norm(x + self.mix(torch.cat([x, prev], -1))))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--corpus-bytes", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stats", help="each rank writes its digests to STATS.rank<R>.json")
    args = p.parse_args()
    torch.set_num_threads(1)

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    text = b"".join(open(f, "rb").read() for f in files)[:args.corpus_bytes]
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()

    job = hotspare.init()                                                        # hotspare
    torch.manual_seed(args.seed)
    model = job.ddp(CharModel())                                                 # hotspare
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=15, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    ds = Windows(data, args.block)
    loader = job.loader(DataLoader(ds, batch_size=args.batch_size,               # hotspare
                                   sampler=DistributedSampler(ds, shuffle=True, seed=args.seed)))
    job.track(model=model, optimizer=opt, scheduler=sched, scaler=scaler)        # hotspare

    for step in job.steps(args.steps):                                           # hotspare
        with step:                                                               # hotspare
            opt.zero_grad(set_to_none=False)
            x, y = next(loader)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, 256), y.view(-1))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            job.log(loss=loss.item())

    if job.rank == 0:
        print(f"finished at loss {loss.item():.4f}, loss scale {scaler.get_scale():.0f}", flush=True)
    if args.stats:
        with open(f"{args.stats}.rank{job.rank}.json", "w") as f:
            json.dump({"digest": job.digest, "rank_digest": job.rank_digest}, f)


if __name__ == "__main__":
    main()
