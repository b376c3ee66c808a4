"""TorchFT (torchft 0.2.0): the example GPT as one replica group per data-parallel rank, coordinated
by a lighthouse, each group launched and restarted by its own torchrun.

    torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 --bind '[::]:29510' &
    for i in 0 1 2 3; do
      REPLICA_GROUP_ID=$i NUM_REPLICA_GROUPS=4 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
        torchrun --master_port=$((29600 + i)) --nnodes=1 --nproc_per_node=1 --max_restarts=100 \\
        bench/peers/torchft_train.py --model 1m --steps 300 &
    done

That is the layout of torchft's own launcher (torchft/torchx.py) and README: the lighthouse
command of the README, replica groups of one worker each (DDP), REPLICA_GROUP_ID /
NUM_REPLICA_GROUPS / TORCHFT_LIGHTHOUSE in the environment, ``--max_restarts`` on each group's
torchrun, so a killed group comes back and heals from a live peer. The Manager is set up like
torchft's train_ddp.py on CPU: ``ProcessGroupGloo(timeout=5 s)``, ``min_replica_size=1``,
``timeout=30 s``, the default HTTP checkpoint transport for live recovery; ``init_sync=False``
because every replica seeds its weights identically (what the Manager's docstring asks for).

Gradients: ``--grad-sync allreduce`` (default) flattens the gradients and reduces them with
``Manager.allreduce`` (one fault-tolerant allreduce per step, averaged over the participants);
``--grad-sync ddp`` uses torchft's ``DistributedDataParallel`` wrapper instead. With the wrapper, a
peer killed in the middle of the gradient exchange can crash the surviving replica: the Manager
swallows the network error, and the wrapper's comm hook then asserts on the missing future
(``assert fut._fut`` in torchft/ddp.py). ``Manager.allreduce`` is the documented primitive
underneath and does not have that problem.

Each replica draws its batch from (seed, replica, step), i.e. exactly the batch that rank
``replica`` draws in the other systems, and prints ``step S loss L | T ms`` when a step commits.
Samples of a replica group that is down (or healing) are never trained on: that is TorchFT's
design, and the harness counts them from ``batches_committed``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO))

from gpt_stdlib import GPT, PRESETS, get_batch, load_corpus  # noqa: E402

from hotspare.runtime.data import seed_step  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to run")
    p.add_argument("--model", choices=PRESETS, default="1m", help="model size preset (the example's)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per replica per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--grad-sync", choices=("allreduce", "ddp"), default="allreduce",
                   help="Manager.allreduce on the flattened gradients (default) or torchft's DDP wrapper")
    p.add_argument("--stats", help="write this replica's digest, loss and counters here "
                                   "(REPLICA is replaced by the replica group id)")
    args = p.parse_args()
    torch.set_num_threads(1)

    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    replica = int(os.environ["REPLICA_GROUP_ID"])
    n_layer, n_head, n_embd, block_size = PRESETS[args.model]
    data = load_corpus(args.corpus_bytes)
    torch.manual_seed(args.seed)
    model = GPT(n_layer, n_head, n_embd, block_size)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"compare_{replica}", timeout=timedelta(seconds=30), init_sync=False)
    net = DistributedDataParallel(manager, model) if args.grad_sync == "ddp" else model
    opt = Optimizer(manager, inner)
    params = [q for q in model.parameters() if q.requires_grad]
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    print(f"[torchft] replica {replica} up (restart {restarts}) at step {manager.current_step()}", flush=True)

    failed_commits = 0
    loss = None
    while manager.current_step() < args.steps:
        step = manager.current_step()
        t0 = time.perf_counter()
        g = seed_step(args.seed, replica, step)
        x, y = get_batch(data, g, args.batch_size, block_size)
        opt.zero_grad(set_to_none=True)           # starts this step's quorum (asynchronously)
        loss = net(x, y)
        loss.backward()
        if args.grad_sync == "allreduce":
            grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
            flat = _flatten_dense_tensors(grads)
            manager.allreduce(flat).wait()        # averaged over participants; errors are recorded
            for q, r in zip(params, _unflatten_dense_tensors(flat, grads)):
                q.grad = r
        opt.step()                                # steps only if every replica group can commit
        if manager.current_step() > step:
            print(f"step {manager.current_step() - 1} loss {loss.item():.4f} | "
                  f"{(time.perf_counter() - t0) * 1000:.0f} ms", flush=True)
        else:
            failed_commits += 1
            print(f"[torchft] replica {replica}: step {step} not committed", flush=True)

    if args.stats:
        from hotspare.runtime.state import StateRegistry
        reg = StateRegistry()
        reg.add("model", model)
        reg.add("optimizer", inner)
        with open(args.stats.replace("REPLICA", str(replica)), "w") as f:
            json.dump({"replica": replica, "digest": reg.digest(),
                       "final_loss": None if loss is None else loss.item(),
                       "batches_committed": manager.batches_committed(), "failed_commits": failed_commits,
                       "restarts": restarts}, f)
    print(f"[torchft] replica {replica} finished at step {manager.current_step()}, "
          f"batches committed {manager.batches_committed()}", flush=True)
    sys.stdout.flush()
    manager.shutdown(wait=False)
    os._exit(0)


if __name__ == "__main__":
    main()
