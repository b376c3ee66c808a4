"""An ordinary DDP script whose shape the flags choose, for the tests of the step contract
(tests/e2e/test_script_shapes.py): BatchNorm, dropout, a DataLoader the training reads through
`job.loader`, and optionally

  --eval-inside N    rank 0 evaluates on a validation DataLoader inside the step, after opt.step(),
                     every N steps (iterating a DataLoader draws from torch's generator)
  --eval-top N       the same at the top of the loop body, before `with step:`
  --eval-between N   the same after the step block
  --sched-after      the LR scheduler steps after the `with step:` block
  --ema              an AveragedModel EMA updated after the block (--ema-untracked: not tracked)
  --unused           a branch taken on some steps, DDP(find_unused_parameters=True)
  --stop-at S        early stopping: every rank leaves the loop after step S
  --raw-loader       the training DataLoader iterated without job.loader (a contract breach)

Each rank writes its digests to STATS.rank<R>.json (--stats), under hotspare run or torchrun.
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hotspare


class Net(nn.Module):
    def __init__(self, unused: bool):
        super().__init__()
        self.inp = nn.Linear(12, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(32, 3)
        self.side = nn.Linear(32, 3) if unused else None

    def forward(self, x, branch: bool = False):
        h = self.drop(torch.relu(self.bn(self.inp(x))))
        if self.side is not None and branch:
            return self.side(h)
        return self.out(h)


def evaluate(model, loader) -> float:
    model.eval()
    total = 0.0
    with torch.no_grad():
        for x, y in loader:
            total += F.cross_entropy(model(x), y).item()
    model.train()
    return total


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-inside", type=int, default=0)
    p.add_argument("--eval-top", type=int, default=0)
    p.add_argument("--eval-between", type=int, default=0)
    p.add_argument("--sched-after", action="store_true")
    p.add_argument("--ema", action="store_true")
    p.add_argument("--ema-untracked", action="store_true")
    p.add_argument("--unused", action="store_true")
    p.add_argument("--stop-at", type=int, default=-1)
    p.add_argument("--raw-loader", action="store_true")
    p.add_argument("--stats")
    a = p.parse_args()
    torch.set_num_threads(1)

    job = hotspare.init()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(640, 12, generator=gen), torch.randint(0, 3, (640,), generator=gen))
    val = DataLoader(TensorDataset(torch.randn(64, 12, generator=gen), torch.randint(0, 3, (64,), generator=gen)),
                     batch_size=16, shuffle=True)
    model = job.ddp(Net(a.unused), find_unused_parameters=a.unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    tracked = dict(model=model, optimizer=opt, scheduler=sched)
    ema = None
    if a.ema or a.ema_untracked:
        ema = AveragedModel(model.module, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        if a.ema:
            tracked["ema"] = ema
    job.track(**tracked)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    if not a.raw_loader:
        loader = job.loader(loader)
    stream = iter(loader) if a.raw_loader else None
    torch.manual_seed(1 + job.rank)           # each rank's own dropout masks

    for step in job.steps(a.steps):
        if a.eval_top and step % a.eval_top == 0 and job.rank == 0:
            evaluate(model.module, val)
        with step:
            x, y = next(stream) if stream is not None else next(loader)
            branch = a.unused and (step + job.rank) % 3 == 1   # some ranks take it, others not
            loss = F.cross_entropy(model(x, branch), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if not a.sched_after:
                sched.step()
            if a.eval_inside and step % a.eval_inside == 0 and job.rank == 0:
                job.log(val=evaluate(model.module, val))
        if a.sched_after:
            sched.step()
        if ema is not None:
            ema.update_parameters(model.module)
        if a.eval_between and step % a.eval_between == 0 and job.rank == 0:
            evaluate(model.module, val)
        if step == a.stop_at:
            break

    if a.stats:
        out = {"digest": job.digest, "rank_digest": job.rank_digest, "committed": job.committed}
        if ema is not None:
            out["ema"] = [p.detach().sum().item() for p in ema.parameters()]
        with open(f"{a.stats}.rank{job.rank}.json", "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
