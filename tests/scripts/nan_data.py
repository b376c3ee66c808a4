"""A script whose data makes rank NAN_RANK's gradients NaN at step NAN_STEP, on whatever device
holds that rank: a numerical problem in the script, not hardware."""
import os
import sys

import torch

import hotspare

job = hotspare.init()
torch.manual_seed(0)
model = job.ddp(torch.nn.Linear(4, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
job.track(model=model, optimizer=opt)
nan_rank, nan_step = int(os.environ["NAN_RANK"]), int(os.environ["NAN_STEP"])
for step in job.steps(int(sys.argv[1])):
    with step:
        g = hotspare.seed_step(0, job.rank, step)
        x = torch.randn(2, 4, generator=g)
        if job.rank == nan_rank and step == nan_step:
            x[0, 0] = float("inf")           # a bad sample
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
