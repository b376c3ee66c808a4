"""What one NVIDIA GPU can verify of hotspare's GPU path (issue 20), in one run (~1-3 minutes).

    python bench/gpu_check.py --out gpu_check.json               # on a machine with a CUDA GPU
    python bench/gpu_check.py --device cuda:1 --snapshot-mb 4096 --out /tmp/gpu.json

Sections, each pass/fail with its measurements (one failing does not stop the others):

  nccl         a world-size-1 NCCL GenerationGroup created, used (all-reduce, supervised wait),
               aborted and rebuilt in-process over 3 generations; the CUDA context survives
  snapshot     DeviceSnapshot: device -> pinned host (side stream) -> device, digests equal;
               bandwidth against a plain tensor.copy_ of the same bytes (pageable and pinned);
               overlap of the snapshot with compute queued after it; buffer reuse
  broadcast    broadcast_state over the NCCL group (CUDA tensors on the wire, a CPU tensor
               staged to the device) and over gloo between 2 processes on this GPU (CUDA
               tensors staged through pinned host memory; receiver on GPU and on CPU)
  warm_spare   take-over time of a fresh process with and without runtime.cudawarm.warm_cuda
               run before it (a subprocess each)
  nvml         NvmlSource readings of the real devices
  burn_in      bf16 matmul checked against a float64 reference, TFLOP/s against the spec table;
               and the float32 admission burn-in

One GPU cannot host a multi-rank NCCL group, so a peer's death during an NCCL collective is not
exercised here. Prints a report; ``--out`` writes the JSON. Exit status: 0 all passed, 1 some
section failed, 2 no CUDA GPU here.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MiB = 1 << 20


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", help="write the results as JSON to this path")
    p.add_argument("--device", default="cuda:0", help="the CUDA device to check (default cuda:0)")
    p.add_argument("--snapshot-mb", type=int, default=2048, help="state snapshotted, MiB (default 2048)")
    p.add_argument("--burn-n", type=int, default=8192, help="bf16 burn-in matrix size (default 8192)")
    p.add_argument("--burn-reps", type=int, default=30, help="bf16 burn-in repetitions (default 30)")
    p.add_argument("--only", nargs="*", default=None,
                   help="run only these sections (nccl snapshot broadcast warm_spare nvml burn_in)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------- nccl
def check_nccl(args, torch, dev):
    import torch.distributed as dist

    from hotspare.pg import GenerationGroup
    from hotspare.pg.nccl import nccl_environment

    store = dist.HashStore()
    gens = []
    for gen in (1, 2, 3):
        g = GenerationGroup(store, gen, 0, 1, f"gen{gen}/", backend="nccl", device=dev, join_timeout_s=30)
        t0 = time.perf_counter()
        g.connect()
        connect_s = time.perf_counter() - t0
        x = torch.full((1 << 20,), float(gen), device=dev)
        t0 = time.perf_counter()
        g.wait(g.allreduce(x), timeout_s=30)
        torch.cuda.synchronize(dev)
        allreduce_s = time.perf_counter() - t0
        correct = bool((x == gen).all())
        t0 = time.perf_counter()
        g.abort()
        abort_s = time.perf_counter() - t0
        stuck = g.abort_stuck
        try:
            w = g.allreduce(torch.ones(4, device=dev))
            g.wait(w, timeout_s=10)
            after = "a collective after abort completed (expected an error)"
        except Exception as e:  # noqa: BLE001 - expected
            after = f"raised {type(e).__name__}"
        g.destroy()
        alive = float((torch.ones(8, device=dev) * 2).sum()) == 16.0
        gens.append({"gen": gen, "connect_s": round(connect_s, 4), "allreduce_s": round(allreduce_s, 5),
                     "abort_s": round(abort_s, 5), "abort_stuck": stuck, "sum_correct": correct, "after_abort": after,
                     "cuda_alive_after_destroy": alive, "dist_initialized_after": dist.is_initialized()})
    env_ok = all(os.environ.get(k) == v for k, v in nccl_environment(30).items()
                 if k != "NCCL_DEBUG")
    ok = env_ok and all(g["sum_correct"] and g["after_abort"].startswith("raised") and not g["abort_stuck"] and
                        g["cuda_alive_after_destroy"] and not g["dist_initialized_after"] for g in gens)
    return ok, {"nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
                "environment_applied": env_ok, "generations": gens}


# --------------------------------------------------------------------------------- snapshot
def _state(torch, dev, mb):
    """A model-like state: a few big tensors, many small ones, mixed dtypes."""
    g = torch.Generator(device=dev).manual_seed(0)
    big = max(1, (mb * MiB - 200 * 4096 * 4) // 4 // 4)
    ts = [torch.randn(big, generator=g, device=dev) for _ in range(4)]
    ts += [torch.randn(4096, generator=g, device=dev) for _ in range(100)]
    ts += [torch.randn(2048, generator=g, device=dev).to(torch.bfloat16) for _ in range(200)]
    return ts


def _compute(torch, dev, ms_target=150):
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    def run(k):
        for _ in range(k):
            a @ a
    run(2)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    run(10)
    torch.cuda.synchronize(dev)
    per = (time.perf_counter() - t0) / 10
    return run, max(1, int(ms_target / 1e3 / per))


def check_snapshot(args, torch, dev):
    from hotspare.transfer import DeviceSnapshot, digest_of

    ts = _state(torch, dev, args.snapshot_mb)
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    want = digest_of(ts)
    snap = DeviceSnapshot()
    snap.start(ts)
    first = snap.wait()
    snap.start(ts)
    warm = snap.wait()
    digest_ok = snap.digest() == want
    # baselines: the same bytes with a plain copy_ into pageable, then pinned host memory
    plain = {}
    for pinned in (False, True):
        hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in ts]
        for h, t in zip(hosts, ts):
            h.copy_(t)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for h, t in zip(hosts, ts):
            h.copy_(t)
        torch.cuda.synchronize(dev)
        plain["pinned" if pinned else "pageable"] = nbytes / (time.perf_counter() - t0) / 1e9
        del hosts
    # overlap: compute queued after start() runs while the DMA copies
    run, k = _compute(torch, dev)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    run(k)
    torch.cuda.synchronize(dev)
    compute_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    snap.start(ts)
    run(k)
    snap.before_write()
    torch.cuda.synchronize(dev)
    snap.wait()
    both_s = time.perf_counter() - t0
    copy_s = warm.seconds
    overlap = max(0.0, (compute_s + copy_s - both_s) / min(compute_s, copy_s))
    # restore into zeroed state
    for t in ts:
        t.zero_()
    restored = snap.restore(ts)
    restore_ok = digest_of(ts) == want
    m = {"bytes": nbytes, "first_allocations": first.allocations, "warm_allocations": warm.allocations,
         "snapshot_gbps": round(warm.gbps, 2), "restore_gbps": round(restored.gbps, 2),
         "plain_copy_pageable_gbps": round(plain["pageable"], 2),
         "plain_copy_pinned_gbps": round(plain["pinned"], 2),
         "compute_alone_s": round(compute_s, 4), "copy_alone_s": round(copy_s, 4),
         "compute_with_snapshot_s": round(both_s, 4), "overlap_fraction": round(min(overlap, 1.0), 3),
         "digest_after_snapshot_equal": digest_ok, "digest_after_restore_equal": restore_ok}
    return digest_ok and restore_ok and warm.allocations == 0, m


# -------------------------------------------------------------------------------- broadcast
def _gloo_peer(rank, port, device, cpu_receiver, q):
    import datetime

    import torch
    import torch.distributed as dist

    from hotspare.transfer import broadcast_state, digest_of

    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    dev = torch.device(device)
    torch.cuda.set_device(dev)
    g = torch.Generator().manual_seed(1)
    src = [torch.randn(3_000_000, generator=g), torch.randn(500, generator=g),
           torch.randint(0, 9, (77,), generator=g), torch.randn(64, 64, generator=g).to(torch.bfloat16)]
    where = "cpu" if (rank == 1 and cpu_receiver) else dev
    ts = [t.to(where) if rank == 0 else torch.zeros_like(t, device=where) for t in src]
    stats = broadcast_state(ts, src=0, group=None, is_source=rank == 0, bucket_bytes=64 * 1024)
    q.put((rank, digest_of(ts) == digest_of(src), stats.gbps))
    dist.barrier()
    os._exit(0)


def check_broadcast(args, torch, dev):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from hotspare.pg import GenerationGroup
    from hotspare.transfer import broadcast_state, checksum

    out = {}
    t = torch.randn(1 << 20, device=dev)
    out["checksum_cpu_equals_cuda"] = checksum(t) == checksum(t.cpu()) and checksum(t[1:]) == checksum(t[1:].cpu())
    g = GenerationGroup(dist.HashStore(), 9, 0, 1, "bcast/", backend="nccl", device=dev)
    g.connect()
    ts = [torch.randn(1 << 20, device=dev), torch.randn(100, device=dev), torch.randn(50, device=dev),
          torch.arange(10)]                               # the CPU tensor is staged onto the device
    stats = broadcast_state(ts, src=0, group=None, is_source=True)
    out["nccl_world1_units"], out["nccl_world1_bytes"] = stats.buckets, stats.bytes
    g.destroy()
    ctx = mp.get_context("spawn")
    for cpu_receiver in (False, True):
        store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
        q = ctx.Queue()
        procs = [ctx.Process(target=_gloo_peer, args=(r, store.port, str(dev), cpu_receiver, q)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            res = sorted(q.get(timeout=120) for _ in procs)     # a crashed peer: Empty, section fails
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        key = "gloo_pinned_gpu_to_cpu" if cpu_receiver else "gloo_pinned_gpu_to_gpu"
        out[key] = {"equal": all(r[1] for r in res), "receiver_gbps": round(res[1][2], 3)}
    ok = (out["checksum_cpu_equals_cuda"] and out["nccl_world1_units"] == 3
          and out["gloo_pinned_gpu_to_gpu"]["equal"] and out["gloo_pinned_gpu_to_cpu"]["equal"])
    return ok, out


# ------------------------------------------------------------------------------- warm spare
TAKEOVER = r"""
import json, sys, time
sys.path.insert(0, {repo!r})
import torch
dev, warm, mb = {dev!r}, {warm!r}, {mb!r}
warmth = None
if warm:
    from hotspare.runtime.cudawarm import warm_cuda
    warmth = warm_cuda(dev, pool_bytes=mb << 20).to_dict()
t0 = time.perf_counter()                       # the take-over: what a spare does once needed
torch.cuda.init(); torch.cuda.set_device(dev)
state = [torch.empty(mb << 18, dtype=torch.float32, device=dev)]
a = torch.ones(1024, 1024, dtype=torch.bfloat16, device=dev)
(a @ a).sum().item()
print(json.dumps({{"takeover_s": time.perf_counter() - t0, "warmth": warmth}}))
"""


def check_warm_spare(args, torch, dev):
    out = {}
    for warm in (False, True):
        code = TAKEOVER.format(repo=str(REPO), dev=str(dev), warm=warm, mb=1024)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
        if r.returncode:
            raise RuntimeError(f"take-over subprocess failed: {r.stderr[-2000:]}")
        out["warm" if warm else "cold"] = json.loads(r.stdout.strip().splitlines()[-1])
    cold, warm = out["cold"]["takeover_s"], out["warm"]["takeover_s"]
    out["saved_s"] = round(cold - warm, 4)
    return warm < cold, out


# ------------------------------------------------------------------------------------- nvml
def check_nvml(args, torch, dev):
    from hotspare.health import types as T
    from hotspare.health.telemetry import NvmlSource

    src = NvmlSource()
    ok, detail = src.status()
    readings = src.poll() if ok else []
    src.close()
    got = [{"device": r.device, "metrics": r.metrics} for r in readings]
    core = (T.TEMP_C, T.POWER_W, T.CLOCK_EVENT_REASONS, T.PCIE_GEN, T.PCIE_WIDTH)
    missing = sorted({k for r in readings for k in core if k not in r.metrics})
    return ok and bool(readings) and not missing, {"status": detail, "readings": got,
                                                    "missing_core_metrics": missing}


# ---------------------------------------------------------------------------------- burn-in
def check_burn_in(args, torch, dev):
    from hotspare.health.checks.burnin import burn_in

    bf16 = burn_in("gpu", str(dev), n=args.burn_n, reps=args.burn_reps, dtype="bfloat16", reference="device")
    fp32 = burn_in("gpu", str(dev), n=4096, reps=10, dtype="float32", reference="host")
    bit = burn_in("gpu", str(dev), n=2048, reps=2, dtype="bfloat16", reference="device", inject="bitflip")
    return bf16.passed and fp32.passed and not bit.passed, {
        "bf16": bf16.to_dict(), "fp32": fp32.to_dict(), "bf16_bitflip_caught": not bit.passed}


SECTIONS = {"nccl": check_nccl, "snapshot": check_snapshot, "broadcast": check_broadcast,
            "warm_spare": check_warm_spare, "nvml": check_nvml, "burn_in": check_burn_in}


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU here (torch {torch.__version__}, CUDA build: "
              f"{torch.version.cuda or 'no'}); run it on a machine with an NVIDIA GPU", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    torch.cuda.set_device(dev)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": torch.cuda.get_device_name(dev),
              "torch": torch.__version__, "cuda": torch.version.cuda, "sections": {}}
    print(f"gpu_check on {report['device']} (torch {torch.__version__}, CUDA {torch.version.cuda})")
    for name, fn in SECTIONS.items():
        if args.only and name not in args.only:
            continue
        t0 = time.perf_counter()
        try:
            ok, m = fn(args, torch, dev)
        except Exception as e:  # noqa: BLE001 - one section's failure is reported, the rest run
            ok, m = False, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        report["sections"][name] = {"passed": bool(ok), "seconds": round(time.perf_counter() - t0, 2), **m}
        print(f"\n== {name}: {'PASS' if ok else 'FAIL'} ({report['sections'][name]['seconds']} s)")
        for k, v in m.items():
            if k != "traceback":
                print(f"   {k}: {json.dumps(v, default=str)[:600]}")
        sys.stdout.flush()
    passed = all(s["passed"] for s in report["sections"].values())
    report["passed"] = passed
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
        print(f"\nJSON: {args.out}")
    print(f"\ngpu_check: {'all sections passed' if passed else 'SOME SECTIONS FAILED'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
