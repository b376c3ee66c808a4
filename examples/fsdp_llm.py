"""A small decoder-only LM trained with FSDP2 the way torchtitan does it, under hotspare.

Run it (CPU, gloo):
    hotspare run --nproc 4 --spares 1 -- examples/fsdp_llm.py --steps 40
    hotspare run --nproc 4 --spares 1 --inject kill:rank=1:step=20 -- examples/fsdp_llm.py --steps 40
    hotspare run --nproc 4 --spares 1 -- examples/fsdp_llm.py --steps 40 --hsdp 2      # 2 x 2 HSDP
    torchrun --nproc-per-node 4 examples/fsdp_llm.py --steps 40                     # same digest

What it uses: `fully_shard` on every block, then on the root; `MixedPrecisionPolicy` (bf16
compute, fp32 gradient reduction); `reshard_after_forward`; gradient accumulation over
micro-batches with `set_requires_gradient_sync(False)` on all but the last; `clip_grad_norm_`
over DTensors; AdamW with a linear warm-up and cosine decay. The hotspare lines are marked:
`hotspare.init()`, `job.device_mesh(...)` instead of `init_device_mesh`, `job.track`, and
`job.steps` + `with step`. A lost rank's shard comes from its buddy's host RAM (or its HSDP
replica); see docs/SHARDED.md.
"""
import argparse
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import hotspare


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.up, self.down = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        return x + self.down(F.silu(self.up(self.norm2(x))))


class LM(nn.Module):
    def __init__(self, vocab, dim, heads, layers, seq):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--micro", type=int, default=2, help="micro-batches accumulated per step")
    p.add_argument("--hsdp", type=int, default=0, help="replica groups (HSDP); 0: plain FSDP")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stats", help="write the final digest to this JSON file (rank 0)")
    args = p.parse_args()
    torch.set_num_threads(1)

    job = hotspare.init()                                                           # hotspare
    vocab, dim, heads, layers, seq = 128, 64, 4, 3, 32
    torch.manual_seed(args.seed)
    model = LM(vocab, dim, heads, layers, seq)
    if args.hsdp:
        mesh = job.device_mesh((args.hsdp, job.world_size // args.hsdp), ("replicate", "shard"))  # hotspare
    else:
        mesh = job.device_mesh((job.world_size,), ("fsdp",))                        # hotspare
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, layer in enumerate(model.layers):
        # the last block's parameters are gathered again at once by backward: keep them
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i < layers - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    warm_cos = lambda s: (s + 1) / args.warmup if s < args.warmup else \
        0.1 + 0.45 * (1 + math.cos(math.pi * (s - args.warmup) / max(1, args.steps - args.warmup)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warm_cos)
    job.track(model=model, optimizer=opt, scheduler=sched)                          # hotspare

    for step in job.steps(args.steps):                                              # hotspare
        with step:                                                                  # hotspare
            g = hotspare.seed_step(args.seed, job.rank, step)                       # hotspare
            opt.zero_grad(set_to_none=True)
            for micro in range(args.micro):
                model.set_requires_gradient_sync(micro == args.micro - 1)
                x = torch.randint(vocab, (4, seq + 1), generator=g)
                logits = model(x[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, vocab), x[:, 1:].reshape(-1)) / args.micro
                loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            job.log(loss=loss.item() * args.micro, grad_norm=norm.full_tensor().item())
        sched.step()

    if args.stats and job.rank == 0:
        with open(args.stats, "w") as f:
            json.dump({"digest": job.digest}, f)
    if job.rank == 0:
        print(f"finished {args.steps} steps, digest {job.digest[:16]}", flush=True)


if __name__ == "__main__":
    main()
