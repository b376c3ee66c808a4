"""An elastic job over virtual ranks (runtime/virtual.py): each process runs its virtual ranks'
micro-batches (one each until the job shrinks), gradients summed in virtual-rank order.
Arguments: STEPS [SLEEP_S per step]. At the end each process prints the digest of every
virtual rank's state it runs (generator, data position) and every sample index it trained per
step. Dropout draws from each virtual rank's own generator; each virtual rank reads
its own DistributedSampler shard, across epoch ends (16 samples per virtual rank and epoch of a
4-rank job: 4 steps)."""
import hashlib
import sys
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hotspare

steps = int(sys.argv[1])
sleep = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0


def make_loader(vrank, vworld):
    g = torch.Generator().manual_seed(1234)
    ds = TensorDataset(torch.arange(64), torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    return DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=vworld, rank=vrank, seed=7))


def say(line):
    sys.stdout.write(line + "\n")       # one write: two workers' lines never share a line
    sys.stdout.flush()


job = hotspare.init()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
vr = job.virtual_ranks(net, make_loader, seed=100, bucket_cap_mb=0.0003)    # several buckets
model = vr.model
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
job.track(model=model, optimizer=opt)
for step in job.steps(steps):
    with step:
        seen = []
        for v, (idx, x, y) in vr.shares():
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            seen.append(f"{v}:{','.join(map(str, idx.tolist()))}")
        opt.step()
        opt.zero_grad(set_to_none=True)
        time.sleep(sleep)
    say(f"ELASTIC step {step} rank {job.rank} trained {' '.join(seen)}")
for v in vr.held:
    say(f"ELASTIC virtual {v} digest {hashlib.sha256(vr.slots[v].numpy().tobytes()).hexdigest()}")
