"""The sections of bench/gpu_check.py, one function each: ``check_<name>(s, args, torch, dev)``
(the failover section, which runs whole jobs, is in bench/gpu_failover.py).

Each runs in a process of its own (gpu_check.py starts it with a time limit) and reports through
``s`` (gpu_check.Section): ``s.step(name)`` bounds a step (an exception ends that step, recorded,
and the section goes on), ``s.expect(criterion, ok, detail)`` records a verdict, ``s.measure``
records numbers. A criterion names what it checks and, where it has one, its threshold.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20

NCCL_JOIN_S, STALL_S, STUCK_WAIT_S = 10.0, 2.0, 0.5
FORMING_JOIN_S = 5.0
_now = time.perf_counter


# -------------------------------------------------------------------------------------- nccl
def _cycles_per_s(torch, dev) -> float:
    """Clock cycles per second of torch.cuda._sleep (a kernel that spins), measured."""
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize(dev)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(50_000_000)
    b.record()
    b.synchronize()
    return 50e6 / (a.elapsed_time(b) / 1e3)


def check_nccl(s, args, torch, dev):
    import torch.distributed as dist

    from hotspare.errors import PeerFailure
    from hotspare.pg import GenerationGroup
    from hotspare.pg.nccl import apply_nccl_environment, nccl_environment

    replaced = apply_nccl_environment(os.environ, NCCL_JOIN_S)    # as the agent does for an NCCL worker
    s.measure(nccl_version=".".join(map(str, torch.cuda.nccl.version())), env_replaced=replaced,
              environment={k: os.environ[k] for k in nccl_environment(NCCL_JOIN_S)},
              stall=f"torch.cuda._sleep for {STALL_S} s on the compute stream, then an all-reduce "
                    f"(its NCCL stream waits for it), waited with a {STUCK_WAIT_S} s deadline")
    cps = None
    with s.step("calibrate torch.cuda._sleep"):
        cps = _cycles_per_s(torch, dev)
        s.measure(sleep_cycles_per_s=round(cps))
    store, rows = dist.HashStore(), []
    for gen in (1, 2, 3):
        row: dict = {"gen": gen}
        rows.append(row)
        with s.step(f"generation {gen}"):
            g = GenerationGroup(store, gen, 0, 1, f"gen{gen}/", backend="nccl", device=dev,
                                join_timeout_s=NCCL_JOIN_S, timeout_s=30)
            try:
                t0 = _now()
                g.connect()
                row["connect_s"] = round(_now() - t0, 4)
                x = torch.full((1 << 20,), float(gen), device=dev)
                t0 = _now()
                work = g.allreduce(x)
                work.wait()
                torch.cuda.synchronize(dev)
                row["allreduce_s"], row["work"] = round(_now() - t0, 5), type(work).__name__
                row["sum_correct"] = bool((x == gen).all())        # world 1: the sum is the tensor itself
                if cps is not None:
                    torch.cuda._sleep(int(STALL_S * cps))
                    stuck = g.allreduce(torch.ones(1 << 20, device=dev))
                    t0 = _now()
                    try:
                        stuck.wait(datetime.timedelta(seconds=STUCK_WAIT_S))
                        row["stuck_wait"] = "returned (expected PeerFailure)"
                    except PeerFailure as e:
                        row["stuck_wait"] = f"PeerFailure: {e}"
                    row["stuck_wait_s"] = round(_now() - t0, 4)
                    row["abort_s_within_wait"] = round(row["stuck_wait_s"] - STUCK_WAIT_S, 4)
                    row["aborted"], row["abort_stuck"] = g.aborted, g.abort_stuck
                    try:
                        g.allreduce(torch.ones(4, device=dev))
                        row["after_abort"] = "accepted (expected a refusal)"
                    except PeerFailure:
                        row["after_abort"] = "refused"
            finally:            # even after an error: the next generation needs torch.distributed free
                t0 = _now()
                g.destroy()
                row["destroy_s"] = round(_now() - t0, 4)
            row["dist_initialized_after"] = dist.is_initialized()
            t0 = _now()
            torch.cuda.synchronize(dev)              # what is left of the busy kernel
            row["synchronize_after_s"] = round(_now() - t0, 4)
            row["cuda_alive"] = float((torch.ones(8, device=dev) * 2).sum()) == 16.0
        s.measure(generations=rows)
    s.expect("3 generations created, all-reduced (correct sum) and destroyed in one process",
             all(r.get("sum_correct") and r.get("dist_initialized_after") is False for r in rows))
    s.expect("NCCL works come back supervised (SupervisedWork: the runtime's work.wait() is group.wait)",
             all(r.get("work") == "SupervisedWork" for r in rows), [r.get("work") for r in rows])
    s.expect(f"a collective stuck behind a busy stream: the supervised wait raised PeerFailure after its "
             f"{STUCK_WAIT_S} s deadline and aborted the generation",
             all(str(r.get("stuck_wait", "")).startswith("PeerFailure") and r.get("aborted") for r in rows),
             [r.get("stuck_wait") for r in rows])
    s.expect("ncclCommAbort returned within the abort deadline (abort_stuck false) every time",
             all(r.get("abort_stuck") is False for r in rows), [r.get("abort_s_within_wait") for r in rows])
    s.expect("an aborted generation refuses further collectives",
             all(r.get("after_abort") == "refused" for r in rows))
    s.expect("the CUDA context is usable after each abort and destroy", all(r.get("cuda_alive") for r in rows))


def _world1(s, torch, dev, store, gen: int, label: str) -> None:
    import torch.distributed as dist

    from hotspare.pg import GenerationGroup
    g = GenerationGroup(store, gen, 0, 1, f"w{gen}/", backend="nccl", device=dev, join_timeout_s=FORMING_JOIN_S)
    try:
        g.connect()
        x = torch.full((1024,), 3.0, device=dev)
        g.allreduce(x).wait()
        ok = bool((x == 3.0).all())
    finally:
        g.destroy()
    s.expect(f"a world-1 generation forms and all-reduces {label}", ok and not dist.is_initialized())


def _forming(s, torch, dev, store, gen: int, rank: int) -> dict:
    """Rank ``rank`` of a world of 2 whose other rank never comes; another thread aborts at 1 s."""
    import torch.distributed as dist

    from hotspare.pg import GenerationGroup
    g = GenerationGroup(store, gen, rank, 2, f"f{gen}/", backend="nccl", device=dev, join_timeout_s=FORMING_JOIN_S)
    threading.Timer(1.0, g.abort).start()
    t0 = _now()
    try:
        g.connect()
        result = "connected (expected a failure)"
    except Exception as e:  # noqa: BLE001 - the outcome is what is measured
        result = f"{type(e).__name__}: {str(e)[:300]}"
    out = {"rank": rank, "result": result, "seconds": round(_now() - t0, 3)}
    g.destroy()
    out["dist_initialized_after_destroy"] = dist.is_initialized()
    s.measure(**{f"rank{rank}_alone": out})
    return out


def check_nccl_forming(s, args, torch, dev):
    import torch.distributed as dist

    from hotspare.pg.nccl import apply_nccl_environment
    apply_nccl_environment(os.environ, FORMING_JOIN_S)
    store = dist.HashStore()
    with s.step("rank 1 alone, aborted at 1 s"):
        r = _forming(s, torch, dev, store, 1, rank=1)
        s.expect("rank 1 waiting for rank 0's NCCL id: the abort ends connect() in < 3 s (PeerFailure, or "
                 "torch's DistBackendError around it)", "aborted while forming" in r["result"] and r["seconds"] < 3, r)
    with s.step("world 1 after it"):
        _world1(s, torch, dev, store, 2, "after an aborted rendezvous")
    with s.step("rank 0 alone, aborted at 1 s"):     # last: the step most likely to hang
        r = _forming(s, torch, dev, store, 3, rank=0)
        s.expect(f"rank 0 waiting for rank 1 inside NCCL's bootstrap: connect() fails within the join timeout "
                 f"+ 10 s ({FORMING_JOIN_S + 10:.0f} s; the abort cannot reach a communicator not yet made)",
                 not r["result"].startswith("connected") and r["seconds"] < FORMING_JOIN_S + 10, r)
    with s.step("world 1 after that"):
        _world1(s, torch, dev, store, 4, "after a rendezvous that timed out")


# ---------------------------------------------------------------------------------- snapshot
def _state(torch, dev, mb):
    """A model-like state: a few big tensors, many small ones, mixed dtypes."""
    g = torch.Generator(device=dev).manual_seed(0)
    big = max(1, (mb * MiB - 200 * 4096 * 4) // 4 // 4)
    ts = [torch.randn(big, generator=g, device=dev) for _ in range(4)]
    ts += [torch.randn(4096, generator=g, device=dev) for _ in range(100)]
    ts += [torch.randn(2048, generator=g, device=dev).to(torch.bfloat16) for _ in range(200)]
    return ts


def _matmuls(torch, dev, seconds: float):
    """A function that queues ``k`` bf16 8192^2 matmuls on the current stream, and the ``k``
    that take about ``seconds``."""
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def run(k):
        for _ in range(k):
            a @ a
    run(2)
    torch.cuda.synchronize(dev)
    t0 = _now()
    run(10)
    torch.cuda.synchronize(dev)
    return run, max(1, int(seconds / ((_now() - t0) / 10)))


def _plain_copy_gbps(torch, dev, ts, nbytes, pinned: bool) -> float:
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in ts]
    for h, t in zip(hosts, ts):
        h.copy_(t)
    torch.cuda.synchronize(dev)
    t0 = _now()
    for h, t in zip(hosts, ts):
        h.copy_(t)
    torch.cuda.synchronize(dev)
    return nbytes / (_now() - t0) / 1e9


def check_snapshot(s, args, torch, dev):
    from hotspare.transfer import DeviceSnapshot, digest_of

    ts = _state(torch, dev, args.snapshot_mb)
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    want = digest_of(ts)
    snap, warm = DeviceSnapshot(), None
    with s.step("snapshot twice (the second reuses the pinned buffers)"):
        snap.start(ts)
        first = snap.wait()
        snap.start(ts)
        warm = snap.wait()
        s.measure(bytes=nbytes, first_allocations=first.allocations, warm_allocations=warm.allocations,
                  snapshot_gbps=round(warm.gbps, 2), first_snapshot_gbps=round(first.gbps, 2))
        s.expect("the host copy is bitwise the device state (digest)", snap.digest() == want)
        s.expect("a second snapshot of the same shapes allocates no pinned memory", warm.allocations == 0,
                 warm.allocations)
    with s.step("plain copy_ of the same bytes"):
        plain = {p: _plain_copy_gbps(torch, dev, ts, nbytes, p) for p in (False, True)}
        s.measure(plain_copy_pageable_gbps=round(plain[False], 2), plain_copy_pinned_gbps=round(plain[True], 2))
        if warm is not None:
            s.measure(snapshot_over_plain_pinned=round(warm.gbps / plain[True], 3),
                      snapshot_over_plain_pageable=round(warm.gbps / plain[False], 3))
            s.expect("the snapshot moves at least half the bandwidth of a plain copy_ into pinned memory",
                     warm.gbps >= 0.5 * plain[True], f"{warm.gbps:.1f} vs {plain[True]:.1f} GB/s")
    with s.step("overlap with matmuls on the compute stream"):
        copy_s = warm.seconds
        run, k = _matmuls(torch, dev, max(0.1, 1.5 * copy_s))
        torch.cuda.synchronize(dev)
        t0 = _now()
        run(k)
        torch.cuda.synchronize(dev)
        compute_s = _now() - t0
        t0 = _now()
        snap.start(ts)                 # the side stream copies while the matmuls run
        run(k)
        snap.before_write()
        torch.cuda.synchronize(dev)
        snap.wait()
        both_s = _now() - t0
        hidden = min(1.0, max(0.0, (compute_s + copy_s - both_s) / copy_s))
        s.measure(matmuls=k, compute_alone_s=round(compute_s, 4), copy_alone_s=round(copy_s, 4),
                  compute_with_snapshot_s=round(both_s, 4), copy_hidden_fraction=round(hidden, 3))
        s.expect("at least half of the copy is hidden behind the compute (side stream + pinned DMA)",
                 hidden >= 0.5, round(hidden, 3))
        s.expect("the snapshot taken during compute is still bitwise the state", snap.digest() == want)
    with s.step("restore into zeroed tensors"):
        for t in ts:
            t.zero_()
        restored = snap.restore(ts)
        torch.cuda.synchronize(dev)
        s.measure(restore_gbps=round(restored.gbps, 2))
        s.expect("restore (pinned host -> device) gives back the state bitwise", digest_of(ts) == want)


# -------------------------------------------------------------------------------------- nvml
def check_nvml(s, args, torch, dev):
    from hotspare.health import types as T
    from hotspare.health.telemetry import NvmlSource

    src = NvmlSource()
    try:
        ok, detail = src.status()
        s.measure(status=detail)
        s.expect("NVML is available to hotspare (nvidia-ml-py, libnvidia-ml)", ok, detail)
        readings = src.poll() if ok else []
    finally:
        src.close()
    s.measure(readings=[{"device": r.device, "metrics": r.metrics} for r in readings])
    core = (T.TEMP_C, T.POWER_W, T.CLOCK_EVENT_REASONS, T.PCIE_GEN, T.PCIE_WIDTH)
    missing = sorted({k for r in readings for k in core if k not in r.metrics})
    s.expect("one reading per GPU, with every core metric (temperature, power, clock events, PCIe)",
             bool(readings) and not missing, {"missing": missing, "devices": len(readings)})
    temps = [r.metrics.get(T.TEMP_C) for r in readings]
    s.expect("the readings are plausible (0 < temperature < 100 C, power > 0 W)",
             bool(readings) and all(t is not None and 0 < t < 100 for t in temps)
             and all((r.metrics.get(T.POWER_W) or 0) > 0 for r in readings),
             {"temp_c": temps, "power_w": [r.metrics.get(T.POWER_W) for r in readings]})


# ----------------------------------------------------------------------------------- burn-in
def check_burn_in(s, args, torch, dev):
    from hotspare.health.checks.burnin import burn_in

    with s.step(f"bf16 n={args.burn_n}"):
        bf16 = burn_in("gpu", str(dev), n=args.burn_n, reps=args.burn_reps, dtype="bfloat16", reference="device")
        m = bf16.measurements
        s.measure(bf16=bf16.to_dict(), tflops=round(m.get("tflops") or 0, 1), peak_tflops=m.get("peak_tflops"),
                  fraction_of_peak=m.get("fraction_of_peak"))
        s.expect("bf16 products within the float64 reference's tolerance (max_err_over_tol < 1)", bf16.passed,
                 bf16.detail)
        s.expect("the device is in the datasheet table (health/checks/specs.py), so TFLOP/s has a peak to "
                 "compare with", m.get("peak_tflops") is not None, m.get("device_name"))
    with s.step("fp32 admission n=4096"):
        fp32 = burn_in("gpu", str(dev), n=4096, reps=10, dtype="float32", reference="host")
        s.measure(fp32=fp32.to_dict())
        s.expect("fp32 admission burn-in passes", fp32.passed, fp32.detail)
    with s.step("bf16 with a flipped bit"):
        bit = burn_in("gpu", str(dev), n=2048, reps=2, dtype="bfloat16", reference="device", inject="bitflip")
        s.expect("an injected bit flip is caught", not bit.passed, bit.detail)


# -------------------------------------------------------------------------------- warm spare
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


def check_warm_spare(s, args, torch, dev):
    out = {}
    for warm in (False, True):
        name = "warm" if warm else "cold"
        with s.step(f"{name} take-over in a fresh process"):
            code = TAKEOVER.format(repo=str(REPO), dev=str(dev), warm=warm, mb=1024)
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
            if r.returncode:
                raise RuntimeError(f"the take-over process exited {r.returncode}: {r.stderr[-2000:]}")
            out[name] = json.loads(r.stdout.strip().splitlines()[-1])
            s.measure(**{name: out[name]})
    if len(out) == 2:
        cold, warm = out["cold"]["takeover_s"], out["warm"]["takeover_s"]
        s.measure(saved_s=round(cold - warm, 4))
        s.expect("with warm_cuda first, the take-over (1 GiB of state + a bf16 matmul) is faster than cold",
                 warm < cold, {"cold_s": round(cold, 4), "warm_s": round(warm, 4)})


# --------------------------------------------------------------------------------- broadcast
def _gloo_peer(rank, port, device, cpu_receiver, q):
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


def check_broadcast(s, args, torch, dev):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from hotspare.pg import GenerationGroup
    from hotspare.transfer import broadcast_state, checksum

    with s.step("checksum on CPU and CUDA"):
        t = torch.randn(1 << 20, device=dev)
        s.expect("the transfer checksum is the same on CPU and CUDA",
                 checksum(t) == checksum(t.cpu()) and checksum(t[1:]) == checksum(t[1:].cpu()))
    with s.step("NCCL world 1, source side"):
        g = GenerationGroup(dist.HashStore(), 9, 0, 1, "bcast/", backend="nccl", device=dev)
        g.connect()
        try:
            ts = [torch.randn(1 << 20, device=dev), torch.randn(100, device=dev), torch.randn(50, device=dev),
                  torch.arange(10)]                               # the CPU tensor is staged onto the device
            stats = broadcast_state(ts, src=0, group=None, is_source=True)
            s.measure(nccl_world1_units=stats.buckets, nccl_world1_bytes=stats.bytes)
            s.expect("broadcast_state over NCCL sends 3 units (CUDA tensors + a staged CPU one)", stats.buckets == 3,
                     stats.buckets)
        finally:
            g.destroy()
    ctx = mp.get_context("spawn")
    for cpu_receiver in (False, True):
        key = "gloo_pinned_gpu_to_cpu" if cpu_receiver else "gloo_pinned_gpu_to_gpu"
        with s.step(key):
            store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
            q = ctx.Queue()
            procs = [ctx.Process(target=_gloo_peer, args=(r, store.port, str(dev), cpu_receiver, q)) for r in range(2)]
            for p in procs:
                p.start()
            try:
                res = sorted(q.get(timeout=40) for _ in procs)     # a crashed peer: Empty, the step fails
            finally:
                for p in procs:
                    p.join(timeout=10)
                    if p.is_alive():
                        p.kill()
            s.measure(**{key: {"equal": all(r[1] for r in res), "receiver_gbps": round(res[1][2], 3)}})
            s.expect(f"{key}: gloo with CUDA tensors through pinned staging, bit exact", all(r[1] for r in res))
