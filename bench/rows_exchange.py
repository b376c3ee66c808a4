"""What the per-rank rows' exchange costs a step, and what the alternatives would, on gloo.

Every step of a hotspare DDP job issues one collective more than torchrun's: the all-gather of
each rank's per-rank state row (runtime/rankstate.py ``RowTable``), started beside the first
gradient bucket and waited for before the optimizer steps. This bench measures, in one run and
side by side, the CPU (all threads of the process: gloo's included) a rank spends per step on:

* ``buckets``: the gradient all-reduces alone (a DDP step's communication under torchrun);
* ``buckets + rows all-gather``: what hotspare issues today;
* ``buckets + rows to one buddy``: a point-to-point send of the row to one peer and a receive
  from another, the design that would halve the rows' cost at 4 ranks and make it independent of
  the world size (not built: see docs/BENCHMARKS.md for why it is not a drop-in change);
* ``buckets + row to the store``: each rank writes its own row to the launcher's TCPStore
  (a synchronous set before the first bucket is issued) and gathers nothing: the buckets'
  all-reduce completing on any rank then proves every rank's row is stored (each wrote before
  it issued its first bucket). What hotspare does since 2026-12-06; the store server's CPU (in
  the launcher) is printed beside it;
* ``buckets, rows in bucket 0``: the rows carried inside the first bucket's all-reduce. Cheapest,
  but it changes the all-reduce's chunking and so the order in which gloo (and NCCL) sum each
  gradient element: the result is no longer bitwise equal to torchrun's (checked below).

Each variant runs the same number of steps with the same idle gap between them (standing in for
forward/backward), the variants interleaved round by round; ratios are to ``buckets``.

    python bench/rows_exchange.py                   # 4 ranks, the 1m example's buckets
    python bench/rows_exchange.py --model 5m --steps 300
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import time

BUCKETS = {"1m": (288896, 578176), "5m": (295936, 4606976)}   # DDP's buckets of examples/gpt_stdlib.py
ROW_BYTES = 10077           # a rank's row in the GPT example (generators + loader position)
VARIANTS = ("buckets", "buckets + rows all-gather", "buckets + rows to one buddy", "buckets + row to the store",
            "buckets, rows in bucket 0")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)          # every thread of this process
    return r.ru_utime + r.ru_stime


def _worker(rank: int, world: int, port: int, store_port: int, args, queue) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    import datetime
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    gen = torch.Generator().manual_seed(rank)
    buckets = [torch.randn(n, generator=gen) for n in BUCKETS[args.model]]
    own = torch.randint(0, 256, (ROW_BYTES,), dtype=torch.uint8, generator=gen)
    table = torch.empty(world * ROW_BYTES, dtype=torch.uint8)
    held = torch.empty(ROW_BYTES, dtype=torch.uint8)
    per_rank = -(-ROW_BYTES // 2)
    carrier = torch.zeros(buckets[0].numel() + world * per_rank)

    def step(variant: str) -> None:
        work = []
        for i, b in enumerate(buckets):
            x = b.clone()
            if i == 0 and variant == VARIANTS[1]:
                work.append(dist.all_gather_into_tensor(table, own, async_op=True))
            elif i == 0 and variant == VARIANTS[2]:
                work += [dist.isend(own, (rank + 1) % world), dist.irecv(held, (rank - 1) % world)]
            elif i == 0 and variant == VARIANTS[3]:
                store.set(f"row/{rank}", own.numpy().tobytes())
            elif i == 0 and variant == VARIANTS[4]:
                carrier[:x.numel()].copy_(x)
                x = carrier
            work.append(dist.all_reduce(x, async_op=True))
            time.sleep(args.gap_ms / 1000 / len(buckets))     # the backward between buckets
        for w in work:
            w.wait()

    def chunking_changes_the_sum() -> bool:
        """Is bucket 0 reduced with the rows appended bitwise equal to bucket 0 reduced alone?"""
        alone = buckets[0].clone()
        dist.all_reduce(alone)
        carrier.zero_()
        carrier[:alone.numel()].copy_(buckets[0])
        dist.all_reduce(carrier)
        return not torch.equal(alone, carrier[:alone.numel()])

    cpu = {v: [] for v in VARIANTS}
    for v in VARIANTS:
        step(v)                                               # warm the connections
    for _ in range(args.rounds):
        for v in VARIANTS:
            dist.barrier()
            c0 = _cpu()
            for _ in range(args.steps):
                step(v)
            cpu[v].append((_cpu() - c0) / args.steps)
    differs = chunking_changes_the_sum()
    queue.put((rank, cpu, differs))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", choices=BUCKETS, default="1m", help="whose DDP buckets to reduce (default 1m)")
    p.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--steps", type=int, default=100, help="steps per variant and round (default 100)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the variants interleaved (default 3)")
    p.add_argument("--gap-ms", type=float, default=20.0, help="idle time per step standing in for compute")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)   # the launcher's
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, store.port, args, queue)) for r in range(args.world)]
    print(f"{args.world} ranks, buckets of the {args.model} example, {args.steps} steps x {args.rounds} rounds "
          f"per variant, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}", flush=True)
    server0 = _cpu()
    for proc in procs:
        proc.start()
    results = [queue.get() for _ in procs]
    server = (_cpu() - server0) / (args.world * (args.steps * args.rounds + 1))
    for proc in procs:
        proc.join()

    def median_of_rounds(v: str) -> float:
        return statistics.median(statistics.mean(r[1][v][i] for r in results) for i in range(args.rounds))

    base = median_of_rounds(VARIANTS[0])
    for v in VARIANTS:
        med = median_of_rounds(v)
        print(f"  {v:28s} CPU per rank per step {1000 * med:6.3f} ms   ratio {med / base:.3f}   "
              f"(+{1000 * (med - base):.3f} ms)")
    print(f"  the store server (the launcher's process): {1000 * server:.3f} ms CPU per rank per step of the "
          "store variant (all of its CPU in the run, counted against that variant alone)")
    print(f"  rows in bucket 0 change the summed gradients' bits: {any(r[2] for r in results)}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    sys.exit(main())
