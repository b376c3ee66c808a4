"""Checkpoint-restart, as people run it today: the example GPT under plain torchrun with
``--max-restarts``, a torch.distributed.checkpoint (DCP) save every K steps, and a reload of the
newest complete checkpoint whenever the workers (re)start.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 4 --max-restarts 100 \\
        --master-port 29517 bench/peers/ckpt_restart.py --model 1m --steps 300 \\
        --ckpt-dir /tmp/ck --ckpt-every 20 --stats stats.json

Model, data and optimizer are the example's own (imported from examples/gpt_stdlib.py, not
copied): the same GPT, the same AdamW, and each rank's batch drawn from (seed, rank, step), which
is what makes a run restarted from a checkpoint reproduce the steps it lost. DDP is stock
``DistributedDataParallel``; hotspare is not involved except for two pure helpers: the
(seed, rank, step) seeding and the state digest, so digests compare across systems (and, with
``--pin-buckets``, hotspare's fixed bucket layout).

Checkpointing follows the DCP recipe (torch.distributed.checkpoint docs, "Getting Started with
DCP"): an ``AppState`` that implements ``Stateful`` with ``get_state_dict``/``set_state_dict``,
``dcp.save`` on every rank (replicated tensors are written once), ``dcp.load`` on restart. A
checkpoint is complete once DCP's coordinator has written its ``.metadata`` file (the last file
written), so one torn by a kill in mid-save is skipped. Saves are synchronous (torchtitan's
default); the save time is printed, the harness uses it as the checkpoint cost C.

Rank 0 prints one line per step (``step S loss L | T ms``) and ``[ckpt]`` lines for saves and
restores, which ``bench/compare.py`` reads as they come.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO))

from gpt_stdlib import GPT, PRESETS, get_batch, load_corpus  # noqa: E402

from hotspare.runtime.data import seed_step  # noqa: E402
from hotspare.runtime.state import StateRegistry  # noqa: E402

CKPT = re.compile(r"^step-(\d{8})$")


class AppState(Stateful):
    """What DCP saves and loads: model and optimizer, through DCP's own state-dict helpers."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def newest_complete(root: Path) -> tuple[int, Path] | None:
    """The newest checkpoint whose ``.metadata`` exists: (next step to run, folder)."""
    found = []
    for p in root.iterdir() if root.is_dir() else ():
        m = CKPT.match(p.name)
        if m and (p / ".metadata").is_file():
            found.append((int(m.group(1)), p))
    return max(found) if found else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to run")
    p.add_argument("--model", choices=PRESETS, default="1m", help="model size preset (the example's)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--ckpt-dir", help="where DCP checkpoints go (and are reloaded from on start)")
    p.add_argument("--ckpt-every", type=int, default=0, metavar="K",
                   help="save a checkpoint after every K steps (0: never)")
    p.add_argument("--keep", type=int, default=2, help="complete checkpoints to keep (default: 2)")
    p.add_argument("--stats", help="rank 0 writes the final digest, loss and save times here")
    p.add_argument("--pin-buckets", action="store_true",
                   help="lay DDP's gradient buckets out once, in parameter order, as hotspare does; stock DDP "
                        "re-buckets after the first step of every process, so a restarted process reduces its "
                        "first step in another layout and the run is no longer bit for bit the fault-free one")
    args = p.parse_args()
    if args.ckpt_every < 0 or (args.ckpt_every and not args.ckpt_dir):
        p.error("--ckpt-every K needs K >= 0 and --ckpt-dir DIR")
    torch.set_num_threads(1)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    n_layer, n_head, n_embd, block_size = PRESETS[args.model]
    data = load_corpus(args.corpus_bytes)
    torch.manual_seed(args.seed)
    model = DDP(GPT(n_layer, n_head, n_embd, block_size))
    if args.pin_buckets:
        from hotspare.runtime.ddp import stabilize_buckets
        stabilize_buckets(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    app = AppState(model, opt)

    root = Path(args.ckpt_dir) if args.ckpt_dir else None
    start = 0
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    latest = newest_complete(root) if root else None
    if latest:
        t0 = time.perf_counter()
        start, path = latest
        dcp.load({"app": app}, checkpoint_id=str(path))
        if rank == 0:
            print(f"[ckpt] restart {restarts}: loaded {path.name} (resume at step {start}) in "
                  f"{time.perf_counter() - t0:.3f} s", flush=True)
    elif rank == 0 and restarts:
        print(f"[ckpt] restart {restarts}: no complete checkpoint, starting from step 0", flush=True)

    saves: list[float] = []
    loss = None
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        g = seed_step(args.seed, rank, step)
        x, y = get_batch(data, g, args.batch_size, block_size)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f} | {(time.perf_counter() - t0) * 1000:.0f} ms", flush=True)
        done = step + 1
        if args.ckpt_every and done % args.ckpt_every == 0 and done < args.steps:
            t0 = time.perf_counter()
            dcp.save({"app": app}, checkpoint_id=str(root / f"step-{done:08d}"))
            saves.append(time.perf_counter() - t0)
            if rank == 0:
                print(f"[ckpt] saved step-{done:08d} in {saves[-1]:.3f} s", flush=True)
                complete = sorted(q for q in root.iterdir() if CKPT.match(q.name) and (q / ".metadata").is_file())
                for old in complete[:-args.keep]:
                    shutil.rmtree(old, ignore_errors=True)

    dist.barrier()
    if rank == 0:
        reg = StateRegistry()
        reg.add("model", model)
        reg.add("optimizer", opt)
        digest = reg.digest()
        if args.stats:
            with open(args.stats, "w") as f:
                json.dump({"digest": digest, "final_loss": None if loss is None else loss.item(),
                           "save_s": saves, "restarts": restarts, "start_step": start}, f)
        print(f"finished {args.steps} steps, final loss {loss.item() if loss is not None else float('nan'):.4f}, "
              f"digest {digest[:16]}", flush=True)
    dist.barrier()
    # gloo's threads can abort a finishing worker at interpreter exit; leave without teardown.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
