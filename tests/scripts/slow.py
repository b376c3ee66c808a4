"""A healthy but slow rank: rank SLOW_RANK sleeps SLOW_S seconds in every step."""
import os
import sys
import time

import torch

import hotspare

job = hotspare.init()
torch.manual_seed(0)
model = job.ddp(torch.nn.Linear(4, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
job.track(model=model, optimizer=opt)
slow_rank, slow_s = int(os.environ["SLOW_RANK"]), float(os.environ["SLOW_S"])
for step in job.steps(int(sys.argv[1])):
    with step:
        if job.rank == slow_rank:
            time.sleep(slow_s)           # slower than the hang floor, but progressing
        g = hotspare.seed_step(0, job.rank, step)
        loss = model(torch.randn(2, 4, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
