"""Recovery benchmark: downtime per failure, steady-state overhead, state-transfer throughput.

    python bench/recovery.py                 # ~5M-parameter GPT, 4 ranks (30-40 minutes on 2 vCPUs)
    python bench/recovery.py --quick         # smaller and shorter, for a smoke check

Everything is measured side by side in one invocation and reported as ratios where a ratio is
the point (this machine is noisy; absolute times are context):
1. downtime per failure, split into detect / decide / rebuild groups / transfer state / first
   committed step, from hotspare's own report of a run with SIGKILLs injected; then downtime per
   fault kind (kill, hang -- where "detect" is the hang-detection latency, fault to fenced --
   exit, the replacement killed during the transfer, a survivor killed while the next generation
   forms, and every rank lost at once, which falls back to a checkpoint);
2. steady-state per-step overhead of hotspare against the same script under plain torchrun:
   CPU and wall time per step of every process of each job, the two jobs running side by side so
   drift hits both alike (bench/overhead.py);
3. state-transfer throughput of hotspare's bucketed, checksummed broadcast against one raw gloo
   broadcast of the same number of bytes;
4. live migration (health service): downtime from the verdict to the next committed step, for a
   degrading device (thermal) and a straggler, next to a SIGKILL failover at the same step;
5. the cost of the health vote (fingerprint + pause agreement): the fingerprint and the other
   checks measured inside the runtime as a share of the step, and end to end (mean step time)
   with no vote during the run, the default period (10) and a vote every step, rotating order.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import measure as side_by_side  # noqa: E402
from procs import free_port  # noqa: E402

from hotspare.testing import run_job  # noqa: E402


# ---------------------------------------------------------------------------- 1. downtime
def downtime(model: str, steps: int, kills: list[int]) -> list[dict]:
    inject = [f"kill:rank={1 + i % 3}:step={s}" for i, s in enumerate(kills)]
    r = run_job(["--model", model, "--steps", str(steps)], nproc=4, spares=1, inject=inject, timeout=1800)
    assert r.code == 0 and r.report, r.output[-3000:]
    return r.report["failures"]


KINDS = {
    "kill": ["kill:rank=1:step={s}"],
    "hang": ["hang:rank=1:step={s}"],
    "exit": ["exit:rank=1:step={s}:code=3"],
    "kill during transfer": ["kill:rank=1:step={s}", "kill:rank=1:phase=transfer:after={s}"],
    "kill during join": ["kill:rank=1:step={s}", "kill:rank=2:phase=join:after={s}"],
    "all ranks (checkpoint)": ["kill:rank=0:step={s}", "kill:rank=1:step={s}", "kill:rank=2:step={s}",
                               "kill:rank=3:step={s}"],
}


def per_kind(model: str, steps: int) -> dict[str, dict]:
    out = {}
    fault_step = steps // 2
    for kind, specs in KINDS.items():
        extra = ["--hang-floor", "2"]
        if kind.startswith("all"):
            tmp = tempfile.mkdtemp()
            extra += ["--checkpoint-dir", tmp, "--checkpoint-every", str(max(1, steps // 5))]
        r = run_job(["--model", model, "--steps", str(steps)], inject=[x.format(s=fault_step) for x in specs],
                    extra=extra, timeout=1800)
        assert r.code == 0 and r.report, r.output[-3000:]
        fails = r.report["failures"]
        first = fails[0]
        downtime = max(f["downtime_s"] or 0 for f in fails)
        out[kind] = {"detect_s": first["phases_s"]["detect"], "downtime_s": downtime,
                     "lost_steps": r.report["steps_lost"], "path": first["recovery_path"],
                     "failures": len(fails)}
    return out


# ---------------------------------------------------------------------------- 2. overhead
# ---------------------------------------------------------------------------- 3. transfer
def _transfer_worker(rank: int, port: int, model: str, reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path.insert(0, str(REPO / "examples"))
    from gpt_stdlib import GPT, PRESETS

    from statecopy import copy_state

    from hotspare.runtime.state import StateRegistry

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.manual_seed(rank)
    m = GPT(*PRESETS[model])
    opt = torch.optim.AdamW(m.parameters())
    if rank == 0:                                     # the source has Adam's state; the receiver,
        m(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)).backward()
        opt.step()                                    # like a fresh spare, has none yet
    reg = StateRegistry()
    reg.add("model", m)
    reg.add("optimizer", opt)
    manifest = json.loads(json.dumps(reg.snapshot().manifest(0)) if rank == 0 else "null")
    store.set("manifest", json.dumps(manifest)) if rank == 0 else None
    manifest = json.loads(store.get("manifest"))
    nbytes = sum(math.prod(shape) * getattr(torch, dt).itemsize for _, dt, shape in manifest["entries"])
    flat = torch.zeros(nbytes // 4)
    hs, raw = [], []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(flat, src=0)
        raw.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        copy_state(reg, manifest, rank)               # exactly what a recovery's StateSync does
        hs.append(time.perf_counter() - t0)
    if rank == 1:
        json.dump({"bytes": nbytes, "hotspare_s": hs, "raw_s": raw}, open(out, "w"))
    dist.barrier()
    os._exit(0)


def transfer(model: str, reps: int) -> dict:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "t.json")
        port = free_port()
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_transfer_worker, args=(r, port, model, reps, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        data = json.load(open(out))
    h, r = statistics.median(data["hotspare_s"]), statistics.median(data["raw_s"])
    return {"bytes": data["bytes"], "hotspare_GBps": data["bytes"] / h / 1e9,
            "raw_GBps": data["bytes"] / r / 1e9, "ratio": r / h}


# ---------------------------------------------------------------------------- 4. live migration
MIGRATIONS = {
    "thermal (92 C) -> migrate": (["thermal:rank=1:temp=92:step={s}"], []),
    "straggler (2x slower) -> migrate": (["slow:rank=1:factor=2:step={s}"], ["straggler_held"]),
    "SIGKILL -> failover (for comparison)": (["kill:rank=1:step={s}"], []),
}


def migration(model: str, steps: int) -> dict[str, dict]:
    out = {}
    s = steps // 4
    with tempfile.TemporaryDirectory() as tmp:
        rules = os.path.join(tmp, "rules.toml")
        with open(rules, "w") as f:           # 2 windows of 10 steps, so it fits in a short run
            f.write('[[rule]]\nname = "straggler"\nheld = 2\n')
        for name, (specs, opts) in MIGRATIONS.items():
            extra = ["--telemetry", "simulated", "--telemetry-period", "0.5"]
            if "straggler_held" in opts:
                extra += ["--health-rules", rules]
            r = run_job(["--model", model, "--steps", str(steps)], inject=[x.format(s=s) for x in specs],
                        extra=extra, timeout=1800)
            assert r.code == 0 and r.report, r.output[-3000:]
            rep = r.report
            if rep["migrations"]:
                m = rep["migrations"][0]
                out[name] = {"detect_s": m["detection_latency_s"], "downtime_s": m["downtime_s"],
                             "pause_s": m["pause_s"], "transfer_s": m["transfer_s"], "stall_s": m["stall_s"],
                             "lost_steps": m["lost_steps"], "outcome": m["outcome"]}
            else:
                f = rep["failures"][0]
                out[name] = {"detect_s": f["detection_latency_s"], "downtime_s": f["downtime_s"],
                             "pause_s": None, "transfer_s": f["phases_s"]["transfer_state"],
                             "stall_s": f["downtime_s"],      # training stands still from the fault
                             "lost_steps": f["lost_steps"], "outcome": f["recovery_path"]}
            out[name]["step_s"] = rep["median_step_time_s"]
    return out


# ---------------------------------------------------------------------------- 5. health-vote cost
VOTE_SETTINGS = {"no vote": "1000000000", "default (every 10)": "10", "strict (every step)": "1"}


def vote_cost(model: str, steps: int, rounds: int) -> dict:
    """Mean step time with the vote never running during the run (a period longer than the
    run: only step 0 votes), at its default period and at every step, in rotating order."""
    names = list(VOTE_SETTINGS)
    times: dict[str, list[float]] = {n: [] for n in names}
    inside = []
    args = ["--model", model, "--steps", str(steps)]
    for i in range(rounds):
        for name in names[i % 3:] + names[:i % 3]:          # rotate: drift hits every setting
            r = run_job(args, extra=["--fingerprint-every", VOTE_SETTINGS[name]], timeout=1800)
            assert r.code == 0 and r.report, r.output[-3000:]
            times[name].append(r.report["mean_step_time_s"])    # votes come every N steps
            if name.startswith("default"):
                inside.append((r.report["fingerprint_s_per_step"], r.report["health_check_s_per_step"],
                               r.report["mean_step_time_s"]))
    base = times["no vote"]
    return {"steps_s": times,
            "ratio_default": statistics.median(a / b for a, b in zip(times["default (every 10)"], base)),
            "ratio_strict": statistics.median(a / b for a, b in zip(times["strict (every step)"], base)),
            "fingerprint_share": statistics.median(fp / st for fp, _, st in inside),
            "all_checks_share": statistics.median(ck / st for _, ck, st in inside),
            "fingerprint_s_per_step": statistics.median(fp for fp, _, _ in inside)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1m model, fewer steps and rounds")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--sections", default="1,2,3,4,5", metavar="LIST",
                   help="which sections to run, e.g. 4,5 (default: all; the summary shows what ran)")
    args = p.parse_args()
    try:
        sections = {int(x) for x in args.sections.split(",")}
    except ValueError:
        p.error(f"--sections {args.sections!r}: a comma-separated list of 1..5")
    if not sections or not sections <= {1, 2, 3, 4, 5}:
        p.error(f"--sections {args.sections!r}: a comma-separated list of 1..5")
    model = "1m" if args.quick else "5m"
    steps, rounds, reps = (60, 2, 10) if args.quick else (150, 3, 40)   # a transfer takes ~30 ms
    print(f"model {model}, 4 ranks + 1 spare, CPU/gloo, {os.cpu_count()} cores", flush=True)

    results: dict = {}
    summary: list[str] = []
    if 1 in sections:
        _section1(model, steps, args.quick, results, summary)
    if 2 in sections:
        _section2(model, steps, rounds, results, summary)
    if 3 in sections:
        _section3(model, reps, results, summary)
    if 4 in sections:
        _section4(model, args.quick, results, summary)
    if 5 in sections:
        _section5(model, steps, rounds, args.quick, results, summary)
    print("\nsummary")
    for line in summary:
        print(line)
    if args.json:
        json.dump(results, open(args.json, "w"), indent=2)


def _section1(model, steps, quick, results, summary) -> None:
    print("\n1. downtime per failure (SIGKILL mid-step, warm spare)", flush=True)
    kills = [15, 40] if quick else [30, 80, 130]
    fails = downtime(model, steps + (20 if quick else 0), kills)
    phases = ["detect", "decide", "rebuild_groups", "transfer_state", "first_committed_step"]
    print(f"   {'step':>5} " + " ".join(f"{ph:>21}" for ph in phases) + f" {'downtime':>9} {'lost':>4}")
    for f in fails:
        print(f"   {f['step']:>5} " + " ".join(f"{1000 * (f['phases_s'][ph] or 0):>18.0f} ms" for ph in phases)
              + f" {f['downtime_s']:>7.2f} s {f['lost_steps']:>4}")
    med_down = statistics.median(f["downtime_s"] for f in fails)

    print("\n1b. downtime per fault kind (one run each, fault in the middle of the run)", flush=True)
    kinds = per_kind(model, 40 if quick else 60)
    print(f"   {'fault':<24} {'detect':>8} {'downtime':>9} {'lost':>5}  path")
    for kind, k in kinds.items():
        det = f"{1000 * k['detect_s']:.0f} ms" if k["detect_s"] is not None else "-"
        print(f"   {kind:<24} {det:>8} {k['downtime_s']:>7.2f} s {k['lost_steps']:>5}  {k['path']}")
    results.update(failures=fails, kinds=kinds)
    summary.append(f"   median downtime per failure        {med_down:.2f} s   (target < 2 s)")


def _section2(model, steps, rounds, results, summary) -> None:
    print("\n2. steady-state overhead vs plain torchrun (same script, both jobs side by side, CPU per step; "
          "bench/overhead.py)", flush=True)
    ov = side_by_side(model, steps, rounds, say=print)
    results["overhead"] = ov
    summary.append(f"   hotspare / torchrun CPU per step   {ov['ratio_median']:.4f}   (median of {rounds} rounds; "
                   "target < 1.005)")
    summary.append(f"   hotspare / torchrun wall per step  {ov['wall_ratio_median']:.4f}   (the same window)")
    summary.append(f"   launcher beyond torchrun's, spare  {100 * ov['launcher_extra_share']:+.3f}%, "
                   f"{100 * ov['spare_share']:.3f}% of torchrun's CPU per step (measured directly)")


def _section3(model, reps, results, summary) -> None:
    print("\n3. state transfer vs raw gloo broadcast of the same bytes (2 processes)", flush=True)
    tr = transfer(model, reps)
    print(f"   {tr['bytes'] / 1e6:.1f} MB: hotspare {tr['hotspare_GBps']:.2f} GB/s, raw {tr['raw_GBps']:.2f} GB/s")
    results["transfer"] = tr
    summary.append(f"   transfer throughput / raw          {tr['ratio']:.2f}     (target >= 0.80)")


def _section4(model, quick, results, summary) -> None:
    print("\n4. live migration: from the health verdict to the next committed step, and the stall "
          "(training standing still)", flush=True)
    mig = migration(model, 80 if quick else 120)
    print(f"   {'signal':<38} {'detect':>8} {'pause':>8} {'transfer':>9} {'verdict->commit':>16} {'stall':>7} "
          f"{'lost':>5}  outcome")
    for name, m in mig.items():
        det = f"{1000 * m['detect_s']:.0f} ms" if m["detect_s"] is not None else "-"
        pause = f"{1000 * m['pause_s']:.0f} ms" if m["pause_s"] is not None else "-"
        print(f"   {name:<38} {det:>8} {pause:>8} {1000 * m['transfer_s']:>6.0f} ms {m['downtime_s']:>14.2f} s "
              f"{m['stall_s']:>5.2f} s {m['lost_steps']:>5}  {m['outcome']}")
    results["migration"] = mig
    thermal = mig["thermal (92 C) -> migrate"]
    kill = mig["SIGKILL -> failover (for comparison)"]["downtime_s"]
    summary.append(f"   live migration (thermal): verdict -> commit {thermal['downtime_s']:.2f} s, stall "
                   f"{thermal['stall_s']:.2f} s ({thermal['stall_s'] / kill:.2f}x a SIGKILL failover's downtime)")


def _section5(model, steps, rounds, quick, results, summary) -> None:
    print("\n5. cost of the health vote (fingerprint + pause agreement), by period", flush=True)
    vc = vote_cost(model, steps, max(3, rounds))
    for k in range(len(vc["steps_s"]["no vote"])):
        print("   " + "   ".join(f"{n} {1000 * vc['steps_s'][n][k]:7.1f} ms" for n in VOTE_SETTINGS))
    print(f"   step time / no vote: default {vc['ratio_default']:.4f}, strict {vc['ratio_strict']:.4f}")
    print(f"   measured inside the step at the default period (averaged over all steps): fingerprint "
          f"{1000 * vc['fingerprint_s_per_step']:.3f} ms = {100 * vc['fingerprint_share']:.3f}% of the step; "
          f"all checks (fingerprint, vote launch, NaN sums) {100 * vc['all_checks_share']:.3f}%")
    results["vote_cost"] = vc
    summary.append(f"   fingerprint share of step time     {100 * vc['fingerprint_share']:.3f}%  (inside the step, "
                   "default period; target < 0.5%)")
    summary.append(f"   step time, default vote / no vote  {vc['ratio_default']:.4f}   (end to end, noisy)")
    summary.append(f"   step time, strict vote / no vote   {vc['ratio_strict']:.4f}")


if __name__ == "__main__":
    main()
