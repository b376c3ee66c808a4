"""A training script with a bug: rank BUG_RANK raises at step BUG_STEP (any process holding it)."""
import os
import sys

import torch

import hotspare

job = hotspare.init()
torch.manual_seed(0)
model = job.ddp(torch.nn.Linear(4, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
job.track(model=model, optimizer=opt)
bug_rank, bug_step = int(os.environ["BUG_RANK"]), int(os.environ["BUG_STEP"])
for step in job.steps(int(sys.argv[1])):
    with step:
        if job.rank == bug_rank and step == bug_step:
            {}["missing_key"]            # the bug: fails in the data path, before the step commits
        g = hotspare.seed_step(0, job.rank, step)
        loss = model(torch.randn(2, 4, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
