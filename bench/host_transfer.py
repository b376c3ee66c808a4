"""State transfer between two hosts: hotspare's transfer against a raw gloo broadcast of the same bytes.

    sudo python bench/host_transfer.py                          # ~2 minutes on 2 vCPUs (root: namespaces)
    sudo python bench/host_transfer.py --sizes 5m,50m --repeats 10

Two hosts made of network namespaces on one bridge (hotspare/testing/netns.py), one process on
each, gloo over their veth pairs (GLOO_SOCKET_IFNAME=eth0, the interface the agent would pick).
For each model size, the GPT's full training state (parameters and AdamW's two moments) goes
from the process on hosta to the one on hostb the way a recovery sends it to a replacement: a
JSON manifest through the store, then ``transfer.broadcast_state`` point to point to the one
receiver (units, checksums) into its registry's tensors, then ``finish_receive``. A raw
``dist.broadcast`` of one flat tensor of the same number of bytes runs between the same two
processes. The two alternate (which goes first flips every repetition); times are the
receiver's, barrier to done; median of ``--repeats``. The receiver's optimizer starts empty, as a
fresh spare's (the first repetition allocates its state), and is overwritten in place after.
Printed: each size's GB/s of both, the ratio hotspare / raw (throughput; 1.0 = as fast as the raw
broadcast) and whether the receiver's state ended bitwise equal to the sender's.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hotspare.testing.netns import Hosts, unavailable  # noqa: E402

SIZES = {  # name: the GPT's (n_layer, n_head, n_embd, block_size), examples/gpt_stdlib.py
    "5m": (6, 8, 256, 128),       # 4.9M parameters, 58.8 MB of state
    "50m": (12, 8, 576, 128),     # 48.2M parameters, 579 MB of state
}
STORE_PORT = 29511               # on hosta's address, inside the bench's own namespaces


# ---------------------------------------------------------------------------- one process per host
def _model(name: str, rank: int):
    import torch
    sys.path.insert(0, str(REPO / "examples"))
    from gpt_stdlib import GPT

    from hotspare.runtime.state import StateRegistry
    torch.manual_seed(rank)
    m = GPT(*SIZES[name])
    opt = torch.optim.AdamW(m.parameters())
    if rank == 0:                 # the source has Adam's state; the receiver, like a fresh spare, none
        m(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)).backward()
        opt.step()
    reg = StateRegistry()
    reg.add("model", m)
    reg.add("optimizer", opt)
    return reg, sum(p.numel() for p in m.parameters())


def _one_size(rank: int, store, name: str, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    from statecopy import copy_state
    reg, params = _model(name, rank)
    if rank == 0:
        store.set(f"manifest/{name}", json.dumps(reg.snapshot().manifest(0)))
    manifest = json.loads(store.get(f"manifest/{name}"))
    nbytes = sum(math.prod(shape) * getattr(torch, dt).itemsize for _, dt, shape in manifest["entries"])
    flat = torch.zeros(nbytes, dtype=torch.uint8)

    def raw() -> None:
        dist.broadcast(flat, src=0)

    def hotspare() -> None:                         # what StateSync.send / .receive do
        copy_state(reg, manifest, rank)

    times: dict[str, list[float]] = {"raw": [], "hotspare": []}
    for i in range(repeats):
        for kind, fn in ((("raw", raw), ("hotspare", hotspare)) if i % 2 == 0 else
                         (("hotspare", hotspare), ("raw", raw))):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[kind].append(time.perf_counter() - t0)
        if rank == 1:
            print(f"  {name}: repetition {i + 1}/{repeats}  raw {times['raw'][-1] * 1e3:7.1f} ms  "
                  f"hotspare {times['hotspare'][-1] * 1e3:7.1f} ms", file=sys.stderr, flush=True)
    store.set(f"digest/{name}/{rank}", reg.digest())       # the whole state, metadata too
    equal = store.get(f"digest/{name}/0") == store.get(f"digest/{name}/1")
    del reg, flat
    gc.collect()
    return {"bytes": nbytes, "params": params, "raw_s": times["raw"], "hotspare_s": times["hotspare"], "equal": equal}


def worker(rank: int, store_at: str, sizes: list[str], repeats: int, out: str) -> int:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    host, port = store_at.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), 2, rank == 0, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    results = {name: _one_size(rank, store, name, repeats) for name in sizes}
    if rank == 1:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------- the bench
def run(sizes: list[str], repeats: int) -> dict:
    net = Hosts(["hosta", "hostb"])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "results.json")
            env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}
            cmd = [sys.executable, __file__, "--sizes", ",".join(sizes), "--repeats", str(repeats),
                   "--store", f"{net['hosta'].addr}:{STORE_PORT}", "--out", out, "--worker"]
            procs = [subprocess.Popen(net.argv(net[h].ns, [*cmd, str(rank)], env))
                     for rank, h in enumerate(("hosta", "hostb"))]
            codes = [p.wait(timeout=1800) for p in procs]
            if codes != [0, 0]:
                raise SystemExit(f"bench/host_transfer.py: a worker failed (exit statuses {codes})")
            return json.loads(Path(out).read_text())
    finally:
        net.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="5m,50m", help=f"model sizes, comma-separated, of {', '.join(SIZES)} "
                                                      "(default 5m,50m)")
    p.add_argument("--repeats", type=int, default=10, help="repetitions of each transfer per size (default 10)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)       # one host's process: its rank
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    sizes = args.sizes.split(",")
    if unknown := [s for s in sizes if s not in SIZES]:
        p.error(f"--sizes: unknown {', '.join(unknown)}; known: {', '.join(SIZES)}")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.worker is not None:
        return worker(args.worker, args.store, sizes, args.repeats, args.out)
    why = unavailable()
    if why:
        print(f"bench/host_transfer.py: {why}", file=sys.stderr)
        return 2
    print(f"state transfer hosta -> hostb (network namespaces on one bridge), sizes {args.sizes}, "
          f"{args.repeats} repetitions each, alternated", file=sys.stderr, flush=True)
    results = run(sizes, args.repeats)
    print(f"\n{'size':>5} {'params':>8} {'state MB':>9} {'raw GB/s':>9} {'hotspare GB/s':>14} {'ratio':>6} "
          f"{'pairs min-max':>14} {'bitwise equal':>14}")
    for name, r in results.items():
        raw, hs = statistics.median(r["raw_s"]), statistics.median(r["hotspare_s"])
        pairs = [a / b for a, b in zip(r["raw_s"], r["hotspare_s"])]
        r.update(raw_GBps=r["bytes"] / raw / 1e9, hotspare_GBps=r["bytes"] / hs / 1e9, ratio=raw / hs)
        print(f"{name:>5} {r['params'] / 1e6:7.1f}M {r['bytes'] / 1e6:9.1f} {r['raw_GBps']:9.2f} "
              f"{r['hotspare_GBps']:14.2f} {r['ratio']:6.2f} {min(pairs):6.2f}-{max(pairs):<7.2f} "
              f"{str(r['equal']):>14}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
