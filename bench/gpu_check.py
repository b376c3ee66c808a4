"""What one NVIDIA GPU can verify of hotspare's GPU path (issue 34), in one call of < 5 minutes.

    python bench/gpu_check.py --out gpu_check.json               # on a machine with a CUDA GPU
    python bench/gpu_check.py --only nccl snapshot --out /tmp/gpu.json

Each section runs in a process of its own with its own time limit, so a hang, a crash or a
broken CUDA context in one cannot stop the others; the whole call keeps within --budget-s
(default 285 s). A section passes when every one of its criteria holds; the JSON says, per
section, what it checks, each criterion with its verdict, what was measured, any error with
its traceback, and the end of its log when it failed. The JSON is rewritten after every
section, so a call cut short still leaves what it found.

  failover      `hotspare run --nproc 4 --spares 1` of bench/gpu_failover_job.py, model and
                optimizer on the GPU: gloo over CUDA tensors (NCCL cannot put two ranks on one
                GPU); fault-free, then rank 2 SIGKILLed at step 20 with the spare's CUDA
                context warm, then cold: final and per-rank digests equal to the fault-free
                run's, the CUDA generator in the per-rank state, take-over time warm vs cold
  nccl          world-size-1 NCCL GenerationGroups over 3 generations in one process: created,
                all-reduced (the supervised work), a collective stuck behind a busy stream
                aborted by the supervised wait's deadline, destroyed and rebuilt; times of each
  snapshot      DeviceSnapshot device -> pinned host -> device, bitwise; its bandwidth as a
                ratio to a plain copy_ of the same bytes; overlapped with bf16 matmuls on the
                compute stream (the copy runs on a side stream): how much of it is hidden
  nvml          NvmlSource (hotspare's telemetry source) readings of the real device
  burn_in       bf16 burn-in at n=8192 against a float64 reference, TFLOP/s against the
                datasheet peak (health/checks/specs.py); fp32 admission burn-in; a bit flip caught
  warm_spare    take-over time of a fresh process with and without warm_cuda first
  broadcast     broadcast_state over NCCL (world 1) and over gloo with CUDA tensors between 2
                processes on this GPU (pinned staging; receiver on GPU and on CPU)
  nccl_forming  an NCCL generation whose peer never comes: aborted while forming (rank 1),
                bounded by the join timeout (rank 0); a world-1 generation afterwards

One GPU cannot host a multi-rank NCCL group, so a peer's death during an NCCL collective is not
exercised. Exit status: 0 every section passed, 1 a section failed (or did not run in the
budget), 2 no CUDA here (it says "no CUDA").
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]
import gpu_failover  # noqa: E402  (the sections themselves: bench/gpu_failover.py, bench/gpu_sections.py)
import gpu_sections  # noqa: E402

# name -> its time limit (seconds); run in this order (the items first)
SECTIONS = {"failover": 150, "nccl": 45, "snapshot": 40, "nvml": 20, "burn_in": 45,
            "warm_spare": 40, "broadcast": 45, "nccl_forming": 40}
# name -> what it checks, in one line (in the JSON and the printed report)
WHAT = {
    "failover": "a real failover on the GPU: hotspare run --nproc 4 --spares 1, gloo over CUDA tensors, "
                "rank 2 SIGKILLed, digests equal to the fault-free run's, spare warm vs cold",
    "nccl": "world-size-1 NCCL generations: create, all-reduce, a stuck collective aborted on its "
            "deadline, destroy, rebuild (x3), with timings",
    "snapshot": "device -> pinned host -> device snapshot bitwise; bandwidth vs plain copy_; copy hidden "
                "behind matmuls on the compute stream",
    "nvml": "hotspare's NvmlSource reads the real device",
    "burn_in": "bf16 burn-in within tolerance, TFLOP/s vs the datasheet peak; fp32 admission; bit flip caught",
    "warm_spare": "take-over of a fresh process with and without warm_cuda first",
    "broadcast": "broadcast_state over NCCL (world 1) and over gloo with CUDA tensors between 2 processes",
    "nccl_forming": "an NCCL generation whose peer never comes: abort while forming, join-timeout bound, "
                    "and a world-1 generation afterwards",
}
MIN_START_S = 15          # a section is not started with less of the budget left


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", help="write the results as JSON to this path")
    p.add_argument("--device", default="cuda:0", help="the CUDA device to check (default cuda:0)")
    p.add_argument("--budget-s", type=float, default=285.0, help="the whole call's time limit (default 285)")
    p.add_argument("--snapshot-mb", type=int, default=2048, help="state snapshotted, MiB (default 2048)")
    p.add_argument("--burn-n", type=int, default=8192, help="bf16 burn-in matrix size (default 8192)")
    p.add_argument("--burn-reps", type=int, default=30, help="bf16 burn-in repetitions (default 30)")
    p.add_argument("--only", nargs="*", default=None, choices=list(SECTIONS), help="run only these sections")
    p.add_argument("--section", choices=list(SECTIONS), help=argparse.SUPPRESS)     # internal: one section
    p.add_argument("--section-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


class Section:
    """What one section found, saved to a file after every change (the parent reads it even if
    this process is killed): criteria (name -> verdict), measurements, errors, the step running."""

    def __init__(self, path: str | None):
        self.path = path
        self.data = {"criteria": {}, "measured": {}, "errors": [], "running": None}

    def save(self) -> None:
        if self.path:
            tmp = f"{self.path}.tmp"
            Path(tmp).write_text(json.dumps(self.data, indent=1, default=str))
            os.replace(tmp, self.path)

    def measure(self, **values) -> None:
        self.data["measured"].update(values)
        self.save()

    def expect(self, criterion: str, ok, detail=None) -> bool:
        self.data["criteria"][criterion] = {"ok": bool(ok), **({} if detail is None else {"detail": detail})}
        self.save()
        return bool(ok)

    @contextmanager
    def step(self, name: str):
        """One step of a section: an exception ends the step (recorded), not the section. Steps
        nest: "running" names the innermost, and the outer one again after it."""
        outer, self.data["running"] = self.data["running"], name
        self.save()
        t0 = time.perf_counter()
        try:
            yield
        except Exception as e:  # noqa: BLE001 - recorded; the section goes on with its next step
            self.data["errors"].append({"step": name, "error": f"{type(e).__name__}: {e}"[:2000],
                                        "traceback": traceback.format_exc()[-4000:]})
        finally:
            self.data["measured"].setdefault("step_seconds", {})[name] = round(time.perf_counter() - t0, 3)
            self.data["running"] = outer
            self.save()


def run_section(args) -> int:
    """In the child: run one section on the device; its findings go to --section-out."""
    s = Section(args.section_out)
    with s.step("set-up (import torch, bind the device)"):
        import torch
        dev = torch.device(args.device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
    if not s.data["errors"]:          # else no device to check: the set-up's error says why
        with s.step("section"):
            check = gpu_failover.check_failover if args.section == "failover" else \
                getattr(gpu_sections, f"check_{args.section}")
            check(s, args, torch, dev)
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: an aborted NCCL communicator or a busy stream must not hang the interpreter's exit
    os._exit(0)


def _child(name: str, args, limit: float, tmp: str) -> dict:
    """Run section ``name`` in a process of its own, at most ``limit`` seconds; its result."""
    out, log = os.path.join(tmp, f"{name}.json"), os.path.join(tmp, f"{name}.log")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--section-out", out,
           "--device", args.device, "--snapshot-mb", str(args.snapshot_mb), "--burn-n", str(args.burn_n),
           "--burn-reps", str(args.burn_reps)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
                                start_new_session=True)      # its group: jobs it starts die with it
        timed_out = False
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
    seconds = time.perf_counter() - t0
    try:
        data = json.loads(Path(out).read_text())
    except (OSError, ValueError):
        data = {"criteria": {}, "measured": {}, "errors": [], "running": "starting Python (nothing recorded yet)"}
    res = {"what": WHAT[name], "seconds": round(seconds, 2), "limit_s": round(limit, 1), **data}
    problems = [c for c, v in data["criteria"].items() if not v["ok"]]
    if timed_out:
        problems.append(f"timed out after {limit:.0f} s" + (f" in step {data['running']!r}" if data["running"] else ""))
    elif code != 0:
        problems.append(f"the section's process exited with {code}" + (
            f" (signal {signal.Signals(-code).name})" if code < 0 else "") +
            (f" in step {data['running']!r}" if data["running"] else ""))
    problems += [f"error in {e['step']}: {e['error'][:300]}" for e in data["errors"]]
    if not data["criteria"] and not problems:
        problems.append("no criterion was checked")
    res["passed"] = not problems
    res["problems"] = problems
    if problems:
        res["log_tail"] = Path(log).read_bytes()[-6000:].decode("utf-8", "replace")
    return res


def _print_section(name: str, r: dict) -> None:
    print(f"\n== {name}: {'PASS' if r['passed'] else 'FAIL'} ({r['seconds']} s of {r.get('limit_s', '-')}) "
          f"-- {r['what']}")
    for c, v in r.get("criteria", {}).items():
        print(f"   [{'ok' if v['ok'] else 'FAILED'}] {c}" + (f": {json.dumps(v['detail'], default=str)[:300]}"
                                                          if "detail" in v else ""))
    for k, v in r.get("measured", {}).items():
        print(f"   {k}: {json.dumps(v, default=str)[:500]}")
    for p in r.get("problems", []):
        if p not in r.get("criteria", {}):          # a failed criterion is shown above
            print(f"   PROBLEM: {p}")
    sys.stdout.flush()


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.section:
        return run_section(args)
    t_begin = time.monotonic()
    import torch

    report = {"script": "bench/gpu_check.py", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "host": socket.gethostname(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "budget_s": args.budget_s}
    if not torch.cuda.is_available():
        why = (f"gpu_check: no CUDA here (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}, "
               f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
               "nothing was checked: run it on a machine with an NVIDIA GPU")
        print(why, file=sys.stderr, flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({**report, "passed": False, "no_cuda": why}, indent=1))
        return 2
    report["device"] = torch.cuda.get_device_name(torch.device(args.device))
    report["sections"] = {}
    print(f"gpu_check on {report['device']} (torch {torch.__version__}, CUDA {torch.version.cuda}), "
          f"budget {args.budget_s:.0f} s", flush=True)

    def write():
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1, default=str))

    with tempfile.TemporaryDirectory(prefix="gpu_check.") as tmp:
        for name, own_limit in SECTIONS.items():
            if args.only and name not in args.only:
                continue
            left = args.budget_s - (time.monotonic() - t_begin)
            if left < MIN_START_S:
                r = {"what": WHAT[name], "seconds": 0, "passed": False,
                     "problems": [f"not run: {left:.0f} s of the {args.budget_s:.0f} s budget left"]}
            else:
                r = _child(name, args, min(own_limit, left), tmp)
            report["sections"][name] = r
            _print_section(name, r)
            write()
    failed = [n for n, r in report["sections"].items() if not r["passed"]]
    report["passed"] = not failed
    report["failed_sections"] = failed
    report["seconds"] = round(time.monotonic() - t_begin, 1)
    write()
    print(f"\ngpu_check: {'every section passed' if not failed else 'FAILED: ' + ', '.join(failed)} "
          f"in {report['seconds']} s" + (f"; JSON: {args.out}" if args.out else ""))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
