"""A script bug: rank 0 alone runs a collective every 5 steps (an all-rank call put under
`if rank == 0`). Its peers never join it; whatever happens, `hotspare run` must end, with a
report and a verdict."""
import sys

import torch
import torch.distributed as dist

import hotspare

job = hotspare.init()
torch.manual_seed(0)
model = job.ddp(torch.nn.Linear(4, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
job.track(model=model, optimizer=opt)
for step in job.steps(int(sys.argv[1])):
    with step:
        g = hotspare.seed_step(0, job.rank, step)
        loss = model(torch.randn(2, 4, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if job.rank == 0 and step % 5 == 4:
        dist.barrier()
