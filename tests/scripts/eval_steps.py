"""Training with an evaluation-only step every 5 steps (no backward, no optimizer step): the
health vote launched as such a step begins is judged when the step ends. The step before each
evaluation lasts 20 ms, so a fault sent to a rank during it lands as the evaluation begins."""
import sys
import time

import torch

import hotspare

job = hotspare.init()
torch.manual_seed(0)
model = job.ddp(torch.nn.Linear(4, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
job.track(model=model, optimizer=opt)
for step in job.steps(int(sys.argv[1])):
    with step:
        g = hotspare.seed_step(0, job.rank, step)
        x = torch.randn(2, 4, generator=g)
        if step % 5 == 0:
            with torch.no_grad():
                job.log(eval_loss=model(x).pow(2).mean().item())
            continue
        if step % 5 == 4:
            time.sleep(0.02)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
