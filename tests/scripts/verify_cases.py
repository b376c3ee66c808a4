"""A small ordinary DDP script for `hotspare verify`'s tests: correct with `--case ok`, or with one
of the mistakes (and hotspare's own weak spots) of issue #28 built in:

  sched-after    `sched.step()` after the `with step:` block (case 2): it runs again for a failed attempt
  rank0-between  a rank-0 evaluation iterating a shuffled DataLoader between steps (case 3)
  untracked-ema  an AveragedModel EMA updated in the step and not given to job.track (case 4)
  unused-params  job.ddp(..., find_unused_parameters=True) and a branch some ranks take at some steps (case 5)

    hotspare verify --nproc 2 -- tests/scripts/verify_cases.py --steps 8 --case untracked-ema
"""
import argparse

import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader, TensorDataset

import hotspare


class Net(nn.Module):
    def __init__(self, branchy=False):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 2)
        self.side = nn.Linear(16, 16) if branchy else None     # used only by the steps that branch
        self.drop = nn.Dropout(0.2)

    def forward(self, x, branch=False):
        h = torch.relu(self.a(x))
        if branch:
            h = h + torch.tanh(self.side(h))
        return self.b(self.drop(h))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--case", default="ok", choices=["ok", "sched-after", "rank0-between", "untracked-ema",
                                                   "unused-params"])
    args = p.parse_args()
    torch.set_num_threads(1)

    job = hotspare.init()
    torch.manual_seed(0)
    branchy = args.case == "unused-params"
    model = job.ddp(Net(branchy), **({"find_unused_parameters": True} if branchy else {}))
    torch.manual_seed(1 + job.rank)                       # dropout masks differ per rank
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ema = AveragedModel(model.module, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    data = torch.Generator().manual_seed(100 + job.rank)
    tracked = dict(model=model, optimizer=opt, scheduler=sched, data=data)
    if args.case != "untracked-ema":
        tracked["ema"] = ema
    job.track(**tracked)
    val = DataLoader(TensorDataset(torch.randn(32, 8, generator=torch.Generator().manual_seed(5))),
                     batch_size=8, shuffle=True)          # shuffling draws from torch's generator

    for step in job.steps(args.steps):
        with step:
            x = torch.randn(16, 8, generator=data)
            y = (x[:, 0] > 0).long()
            branch = branchy and bool(x[0, 0] > 0.3)        # data-dependent: differs between ranks
            loss = nn.functional.cross_entropy(model(x, branch), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ema.update_parameters(model.module)
            if args.case != "sched-after":
                sched.step()
        if args.case == "sched-after":
            sched.step()
        if args.case == "rank0-between" and job.rank == 0 and step % 3 == 0:
            with torch.no_grad():
                sum(model.module(v).sum() for (v,) in val)


if __name__ == "__main__":
    main()
