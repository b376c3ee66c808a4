"""What an ordinary script sees around hotspare.init(): each worker writes, right after init,
its rank, world size and default process group to OUT/after-init-<worker>; registers an atexit
handler that writes OUT/atexit-<worker>; and, after the loop, OUT/after-loop-<worker>.
Arguments: OUT STEPS [untracked-scheduler | rank-dependent-total]."""
import atexit
import os
import sys

import torch
import torch.distributed as dist

import hotspare

out, steps = sys.argv[1], int(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else ""
worker = os.environ.get("HOTSPARE_WORKER_ID", f"rank{os.environ.get('RANK', 0)}")
atexit.register(lambda: open(os.path.join(out, f"atexit-{worker}"), "w").close())

job = hotspare.init()
with open(os.path.join(out, f"after-init-{worker}"), "w") as f:
    f.write(f"{job.rank} {job.world_size} {dist.get_rank()} {dist.get_world_size()}")
seed = 1000 + job.rank                  # would fail on a spare whose rank were None
torch.manual_seed(0)
model = job.ddp(torch.nn.Linear(4, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, 5)
if mode == "untracked-scheduler":
    job.track(model=model, optimizer=opt)
else:
    job.track(model=model, optimizer=opt, scheduler=sched)
total = steps + (job.rank == 1) if mode == "rank-dependent-total" else steps
for step in job.steps(total):
    with step:
        g = hotspare.seed_step(seed, job.rank, step)
        loss = model(torch.randn(2, 4, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
open(os.path.join(out, f"after-loop-{worker}"), "w").close()
