"""The training job of bench/gpu_check.py's failover section: an MLP with dropout whose model and
optimizer live on one CUDA device that every rank shares.

    hotspare run --nproc 4 --spares 1 --inject kill:rank=2:step=20 -- bench/gpu_failover_job.py --steps 40

Four ranks on one GPU talk over gloo with CUDA tensors (NCCL cannot put two ranks on one device).
Dropout draws from the CUDA generator, seeded differently on each rank: a replacement that did not
receive its predecessor's CUDA generator state (hotspare's per-rank state) would draw other masks,
and the final digest would differ from the fault-free run's. ``--warm`` creates the CUDA context
before ``hotspare.init()`` (where a spare waits), so a spare takes over with CUDA already warm.
``--stats DIR``: each rank that reaches the end writes ``DIR/rank<R>.json`` (how it started, where
its parameters live, its per-rank state's parts, the warm-up's timings). ``--device cpu`` runs the
same job on CPU (to try the harness without a GPU).
"""
import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warm", action="store_true", help="warm_cuda() before hotspare.init()")
    p.add_argument("--stats", help="directory for each rank's rank<R>.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    started_as = os.environ.get("HOTSPARE_ROLE", "unmanaged")
    warmth = None
    if args.warm:       # a spare's CUDA start-up paid while it waits, not in its take-over
        from hotspare.runtime.cudawarm import warm_cuda
        warmth = warm_cuda(args.device if dev.type == "cuda" else None, pool_bytes=64 << 20).to_dict()

    import hotspare
    job = hotspare.init()                     # a spare waits here until it takes a rank
    t_rank = time.time()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    torch.manual_seed(0)                      # the same initial model on every rank
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1),
                          nn.Linear(1024, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 10)).to(dev)
    if dev.type == "cuda":
        torch.cuda.manual_seed(1000 + job.rank)   # per-rank dropout masks: the CUDA generator differs per rank
    model = job.ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    job.track(model=model, optimizer=opt)

    for step in job.steps(args.steps):
        with step:
            g = hotspare.seed_step(7, job.rank, step)
            x = torch.randn(64, 256, generator=g).to(dev)
            y = torch.randint(0, 10, (64,), generator=g).to(dev)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    if args.stats:
        try:
            parts = [p.name for p in job.rankstate.layout()]
        except Exception as e:  # noqa: BLE001 - an internal attribute; say so rather than fail the job
            parts = [f"unknown: {type(e).__name__}: {e}"]
        stats = {"rank": job.rank, "pid": os.getpid(), "started_as": started_as,
                 "param_device": str(next(model.parameters()).device),
                 "optimizer_state_device": str(next(iter(opt.state.values()))["exp_avg"].device),
                 "rank_state_parts": parts, "warmth": warmth, "rank_taken_at": t_rank,
                 "digest": job.digest, "rank_digest": job.rank_digest}
        with open(os.path.join(args.stats, f"rank{job.rank}.json"), "w") as f:
            json.dump(stats, f)


if __name__ == "__main__":
    main()
