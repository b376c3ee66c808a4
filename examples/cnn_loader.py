"""A small CNN with BatchNorm and Dropout, trained the way vision scripts usually are: a DataLoader
with a DistributedSampler, loader workers, random augmentations and a custom collate function,
an epoch loop with `set_epoch`, OneCycleLR, gradient clipping and an evaluation on rank 0 after
every epoch.

Run it (CPU, gloo):
    hotspare run --nproc 4 --spares 1 -- examples/cnn_loader.py --epochs 3
    hotspare run --nproc 4 --spares 1 --inject kill:rank=0:step=20 -- examples/cnn_loader.py --epochs 3
    torchrun --nproc-per-node 4 examples/cnn_loader.py --epochs 3      # the same digests

The hotspare lines are marked `# hotspare`: init, job.ddp, job.track (the scheduler too),
job.loader around the DataLoader, job.epochs for the epoch loop and `with job.step()` around
the body of the batch loop. Everything else is the plain DDP script.
"""
import argparse
import json
import random

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import hotspare


class Shapes(Dataset):
    """16x16 images of one of 4 patterns (stripes, checks, a blob, a ring) at a random place,
    made from the index: no download, the same on every machine."""

    def __init__(self, n, seed, augment):
        self.n, self.seed, self.augment = n, seed, augment

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = int(torch.randint(4, (), generator=g))
        yy, xx = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
        cy, cx = (torch.rand(2, generator=g) * 8 + 4).tolist()
        r = ((yy - cy) ** 2 + (xx - cx) ** 2).sqrt()
        img = [torch.sin(xx * 1.3), torch.sign(torch.sin(xx) * torch.sin(yy)), (-r / 3).exp(),
               ((r - 4).abs() < 1).float()][label]
        img = img + 0.3 * torch.randn(16, 16, generator=g)
        if self.augment:                     # in the loader's workers, from their own seeds
            if torch.rand(()) < 0.5:
                img = img.flip(1)
            img = img + 0.1 * torch.randn(16, 16)
        return img.unsqueeze(0), label


def collate(batch):
    images, labels = zip(*batch)
    return torch.stack(images), torch.tensor(labels)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.drop, self.fc = nn.Dropout(0.2), nn.Linear(32 * 4 * 4, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(self.drop(x.flatten(1)))


def evaluate(model, loader):
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(1) == y).sum().item()
            total += len(y)
    model.train()
    return correct / total


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=512, help="training images")
    p.add_argument("--batch-size", type=int, default=16, help="images per rank per step")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stats", help="each rank writes its digests to STATS.rank<R>.json")
    args = p.parse_args()
    torch.set_num_threads(1)

    job = hotspare.init()                                                        # hotspare
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    model = job.ddp(Net())                                                       # hotspare
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    train = Shapes(args.samples, args.seed, augment=True)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed)
    loader = job.loader(DataLoader(train, batch_size=args.batch_size, sampler=sampler,  # hotspare
                                   num_workers=args.workers, collate_fn=collate))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(loader))
    job.track(model=model, optimizer=opt, scheduler=sched)                       # hotspare
    test_loader = DataLoader(Shapes(128, args.seed + 1, augment=False), batch_size=64, collate_fn=collate)

    for epoch in job.epochs(args.epochs):                                        # hotspare
        sampler.set_epoch(epoch)
        for x, y in loader:
            with job.step():                                                     # hotspare
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
        if job.rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}, test accuracy {evaluate(model.module, test_loader):.3f}",
                  flush=True)

    if args.stats:
        with open(f"{args.stats}.rank{job.rank}.json", "w") as f:
            json.dump({"digest": job.digest, "rank_digest": job.rank_digest,
                       "parts": job.rankstate.part_digests(job.rankstate.capture())}, f)


if __name__ == "__main__":
    main()
