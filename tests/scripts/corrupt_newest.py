"""A small model that, on rank 0 at step CORRUPT_AT, damages the newest checkpoint on disk (the
one LATEST names once it names step CORRUPT_STEP): the newest copy is bad when it is needed."""
import os
import sys
import time

import torch

import hotspare

job = hotspare.init()
torch.manual_seed(0)
model = job.ddp(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
job.track(model=model, optimizer=opt)
corrupt_at, corrupt_step = int(os.environ["CORRUPT_AT"]), int(os.environ["CORRUPT_STEP"])
directory = os.environ.get("HOTSPARE_CHECKPOINT_DIR", "")
for step in job.steps(int(sys.argv[1])):
    with step:
        if job.rank == 0 and step == corrupt_at and os.environ.get("CORRUPT", "1") == "1":
            latest = os.path.join(directory, "LATEST")
            want = f"step-{corrupt_step:09d}"
            deadline = time.time() + 30
            while time.time() < deadline and not (os.path.exists(latest) and open(latest).read().strip() == want):
                time.sleep(0.01)
            data = next(f for f in os.listdir(os.path.join(directory, want)) if f.endswith(".distcp"))
            with open(os.path.join(directory, want, data), "r+b") as f:
                f.seek(os.path.getsize(f.name) // 2)
                f.write(b"\xff" * 8)
        g = hotspare.seed_step(0, job.rank, step)
        loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        job.log(loss=loss.item())
print(f"digest {job.digest[:16]}")
