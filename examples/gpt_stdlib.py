"""A character-level GPT trained on the Python standard library's own .py files, with DDP.

Run it (CPU, gloo):
    hotspare run --nproc 4 --spares 1 -- examples/gpt_stdlib.py --steps 200
    hotspare run --nproc 4 --spares 1 --inject kill:rank=2:step=60 -- examples/gpt_stdlib.py --steps 200
    torchrun --nproc-per-node 4 examples/gpt_stdlib.py --steps 200      # plain torchrun works too
    python examples/gpt_stdlib.py --steps 20                             # one process
    hotspare run --nproc 4 --spares 1 -- examples/gpt_stdlib.py --fsdp   # FSDP2 (--hsdp: 2 x 2 HSDP)

Compared with a plain DDP script, the hotspare lines are marked `# hotspare`: init instead of
init_process_group, job.ddp instead of DDP, job.track, job.steps + `with step`, and data and
randomness drawn from (seed, rank, step) so a replacement rank reproduces its predecessor.
"""
import argparse
import glob
import json
import os
import sysconfig

import torch
import torch.nn as nn
import torch.nn.functional as F

import hotspare

PRESETS = {  # name: (n_layer, n_head, n_embd, block_size)
    "tiny": (2, 2, 32, 32),     # tests: ~30k parameters
    "1m": (4, 4, 128, 64),      # the demo: ~0.9M parameters
    "5m": (6, 8, 256, 128),     # benchmarks: ~4.8M parameters
}


class Block(nn.Module):
    def __init__(self, n_head, n_embd):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, block_size, vocab=256):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_head, n_embd) for _ in range(n_layer)])
        self.ln, self.head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        logits = self.head(self.ln(self.blocks(x)))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def load_corpus(max_bytes):
    """The standard library's top-level .py files, as bytes (vocabulary: 256)."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    data = b"".join(open(f, "rb").read() for f in files)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def get_batch(data, g, batch_size, block_size):
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=g)
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to run")
    p.add_argument("--model", choices=PRESETS, default="1m", help="model size preset")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--stats", help="write the final state digest and step times to this JSON file (rank 0)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard per block, bf16 compute) instead of DDP")
    p.add_argument("--hsdp", action="store_true", help="HSDP: FSDP2 over a (2, world/2) replicate x shard mesh")
    args = p.parse_args()
    torch.set_num_threads(1)  # one compute thread per CPU worker: 4 workers on 2 cores otherwise crawl

    data = load_corpus(args.corpus_bytes)     # before init(): a spare has it ready when it takes a rank
    job = hotspare.init()                                                  # hotspare
    n_layer, n_head, n_embd, block_size = PRESETS[args.model]
    torch.manual_seed(args.seed)
    if args.fsdp or args.hsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        model = GPT(n_layer, n_head, n_embd, block_size)
        mesh = (job.device_mesh((2, job.world_size // 2), ("replicate", "shard")) if args.hsdp   # hotspare
                else job.device_mesh((job.world_size,), ("fsdp",)))                             # hotspare
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    else:
        model = job.ddp(GPT(n_layer, n_head, n_embd, block_size))          # hotspare
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    job.track(model=model, optimizer=opt)                                  # hotspare

    loss = None
    for step in job.steps(args.steps):                                     # hotspare
        with step:                                                         # hotspare
            g = hotspare.seed_step(args.seed, job.rank, step)              # hotspare
            x, y = get_batch(data, g, args.batch_size, block_size)
            loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if args.fsdp or args.hsdp:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            job.log(loss=loss.item())

    if args.stats and job.rank == 0:
        with open(args.stats, "w") as f:
            json.dump({"digest": job.digest, "step_times": job.step_times}, f)
    if job.rank == 0 and loss is not None:
        n = sum(p.numel() for p in model.parameters())
        print(f"finished {args.steps} steps, {n / 1e6:.2f}M parameters, final loss {loss.item():.4f}, "
              f"digest {job.digest[:16]}", flush=True)


if __name__ == "__main__":
    main()
