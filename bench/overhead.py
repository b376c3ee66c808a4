"""Steady-state overhead of hotspare against plain torchrun, the two jobs running side by side.

    python bench/overhead.py                          # 5M model, 4 ranks each, 3 rounds (~13 min)
    python bench/overhead.py --model 1m --steps 300   # quicker
    python bench/overhead.py --observe                # hotspare with --metrics (scraped every second) and --events on
    python bench/overhead.py --model 1m --sharded fsdp  # FSDP2 (buddy snapshots on) against torchrun's FSDP2
    PYTHONPATH=/path/to/other/checkout python bench/overhead.py   # measure another hotspare

Run one after the other, the two jobs meet different machines: on a shared 2-core VM the step
time drifts by a few percent from minute to minute, more than the effect being measured. So here
they run at the same time, on the same cores, with the same script and arguments: whatever the
machine does meanwhile (other tenants, clock, cache pressure) hits both alike. Each job's cost is
its CPU time per step over the window in which both are in steady state: the CPU of every
process of the job (launcher, workers, the spare, all their threads: /proc's schedstat), between
two of its own step lines, over the steps between. Start-up and shutdown fall outside the window.
The ratio hotspare / torchrun is computed per round; the rounds alternate which job starts first.

CPU time is the main measure: on a machine the job has to itself (CPU-bound, every core busy, as
here), CPU per step is what sets the step time. The wall time per step over the same window is
printed beside it: sharing the cores, a job that spent time waiting (on a socket, a lock) rather
than computing would leave the cores to the other job and fall behind it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from procs import descendants, environ, free_port

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "gpt_stdlib.py"
# torchrun: rank 0 of the example prints "step N loss ..."; hotspare's launcher "[hotspare t] step N/T".
SCRIPT_EXTRA: list[str] = []     # --sharded: the example's --fsdp / --hsdp
STEP_LINE = re.compile(r"(?:^|\] )step\s+(\d+)")


def _tasks_cpu_s(pid: int) -> dict[str, float]:
    """On-CPU time of each thread of ``pid`` by kind (``schedstat``: nanoseconds, not 10 ms
    ticks): "main" (the process's first thread), else the thread's name (``comm``)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            ns = int(f.read().split()[0])
        if int(tid) == pid:
            kind = "main"
        else:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                kind = f.read().strip()
        out[kind] = out.get(kind, 0.0) + ns / 1e9
    return out


def _role(pid: int) -> str:
    """'worker' (a training rank), 'spare' (a warm spare) or 'launcher' (everything else: the
    launcher and its agent, coordinator and health service threads; torchrun's elastic agent)."""
    env = environ(pid)
    if env.get("HOTSPARE_ROLE") == "spare":
        return "spare"
    return "worker" if "LOCAL_RANK" in env else "launcher"


ROLES = ("launcher", "worker", "spare")


def tree_cpu_s(root: int) -> dict[str, float]:
    """On-CPU time of ``root`` and every process below it, all their threads, in seconds, by role;
    the workers' also by thread kind, under "worker/<kind>"."""
    total = dict.fromkeys(ROLES, 0.0)
    for pid in (root, *descendants(root)):
        try:
            role, threads = _role(pid), _tasks_cpu_s(pid)
        except OSError:          # exited meanwhile
            threads = {}
        for kind, cpu in threads.items():
            total[role] += cpu
            if role == "worker":
                total[f"worker/{kind}"] = total.get(f"worker/{kind}", 0.0) + cpu
    return total


class Job:
    """One job started in the background; records (step, CPU of its tree) at each step line."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str]):
        self.name, self.points, self.tail = name, [], []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.tail = (self.tail + [line])[-40:]
            m = STEP_LINE.search(line)
            if m:
                self.points.append((time.monotonic(), int(m.group(1)), tree_cpu_s(self.proc.pid)))

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self.reader.join(5)
        return code


def per_step(points: list[tuple[float, int, dict]], t0: float, t1: float) -> tuple[dict[str, float], int]:
    """CPU seconds per step, by role and in all, and wall seconds per step ("wall"), between the
    first and last step line inside [t0, t1]."""
    inside = [p for p in points if t0 <= p[0] <= t1]
    if len(inside) < 2:
        raise RuntimeError("fewer than two step lines inside the common window: run more steps")
    (w0, s0, c0), (w1, s1, c1) = inside[0], inside[-1]
    out = {key: (c1[key] - c0.get(key, 0.0)) / (s1 - s0) for key in c1}
    out["all"] = sum(out[role] for role in ROLES)
    out["wall"] = (w1 - w0) / (s1 - s0)
    return out, s1 - s0


def commands(model: str, steps: int, port: int, observe: tuple[int, str] | None = None) -> dict[str, list[str]]:
    """``observe``: (metrics port, events file) to run hotspare with --metrics and --events on."""
    script = [str(EXAMPLE), "--model", model, "--steps", str(steps), *SCRIPT_EXTRA]
    watch = [] if observe is None else ["--metrics", f"127.0.0.1:{observe[0]}", "--events", observe[1]]
    return {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                     "--master-port", str(port), *script],
        "hotspare": [sys.executable, "-m", "hotspare", "run", "--nproc", "4", "--spares", "1",
                     "--log-every", "1", *watch, "--", *script],
    }


class Scraper:
    """GET /metrics every ``period`` seconds while the jobs run, as Prometheus would (its cost
    lands in hotspare's launcher); counts the scrapes that answered."""

    def __init__(self, port: int, period: float = 1.0):
        self.url, self.period, self.ok = f"http://127.0.0.1:{port}/metrics", period, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import urllib.request
        while not self._stop.wait(self.period):
            try:
                with urllib.request.urlopen(self.url, timeout=2) as r:
                    self.ok += bool(r.read())
            except OSError:
                pass                      # not up yet, or already gone

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.ok


def one_round(model: str, steps: int, warmup: int, first: str, port: int, observe: bool = False) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "HOTSPARE_LOG_EVERY_S": "0"}   # torchrun's rank 0 prints every step: the window's marks
    import tempfile
    tmp = tempfile.mkdtemp(prefix="overhead-")
    metrics_port = free_port() if observe else 0
    cmds = commands(model, steps, port, (metrics_port, os.path.join(tmp, "events.jsonl")) if observe else None)
    order = [first] + [n for n in cmds if n != first]
    jobs = {n: Job(n, cmds[n], env) for n in order}
    scraper = Scraper(metrics_port) if observe else None
    for job in jobs.values():
        code = job.wait(3600)
        if code != 0:
            raise RuntimeError(f"{job.name} exited with {code}:\n{''.join(job.tail)}")
    scrapes = scraper.stop() if scraper is not None else None
    # The common steady-state window: both past warm-up, neither in its last steps yet.
    start = max(next(t for t, s, _ in j.points if s >= warmup) for j in jobs.values())
    end = min(next(t for t, s, _ in j.points if s >= steps - 3) for j in jobs.values())
    out = {"first": first, "window_s": end - start, "observed": observe, "scrapes": scrapes}
    for n, j in jobs.items():
        out[n], out[f"{n}_steps"] = per_step(j.points, start, end)
    out["ratio"] = out["hotspare"]["all"] / out["torchrun"]["all"]
    out["workers_ratio"] = out["hotspare"]["worker"] / out["torchrun"]["worker"]
    out["wall_ratio"] = out["hotspare"]["wall"] / out["torchrun"]["wall"]
    return out


def measure(model: str = "5m", steps: int = 120, rounds: int = 3, warmup: int = 10, say=print,
            observe: bool = False) -> dict:
    results = []
    for r in range(rounds):
        first = ("torchrun", "hotspare")[r % 2]
        res = one_round(model, steps, warmup, first, free_port(), observe)
        results.append(res)
        t, h = res["torchrun"], res["hotspare"]
        say(f"   round {r + 1}: CPU per step, torchrun {1000 * t['all']:7.1f} ms ({res['torchrun_steps']} steps), "
            f"hotspare {1000 * h['all']:7.1f} ms ({res['hotspare_steps']} steps): ratio {res['ratio']:.4f}   "
            f"[{first} started first, window {res['window_s']:.0f} s"
            + (f"; hotspare observed: {res['scrapes']} scrapes of /metrics, events file on]" if observe else "]"))
        say(f"      workers {1000 * t['worker']:7.1f} / {1000 * h['worker']:7.1f} ms (ratio {res['workers_ratio']:.4f})"
            f"   launcher {1000 * t['launcher']:5.2f} / {1000 * h['launcher']:5.2f} ms   spare {1000 * h['spare']:5.2f} ms"
            f"   wall/step {1000 * t['wall']:6.1f} / {1000 * h['wall']:6.1f} ms (ratio {res['wall_ratio']:.4f})")
        kinds = sorted({k for k in (*t, *h) if k.startswith("worker/")}, key=lambda k: -h.get(k, 0.0))
        say("      workers' threads: " + ", ".join(
            f"{k[7:]} {1000 * t.get(k, 0.0):.1f} / {1000 * h.get(k, 0.0):.1f}" for k in kinds) + " ms")
    ratios = [r["ratio"] for r in results]
    base = statistics.median(r["torchrun"]["all"] for r in results)
    extra = {role: statistics.median(r["hotspare"][role] - (r["torchrun"][role] if role != "spare" else 0.0)
                                     for r in results) / base for role in ("launcher", "spare")}
    return {"model": model, "steps": steps, "observe": observe, "rounds": results, "ratio_median": statistics.median(ratios),
            "ratio_mean": statistics.mean(ratios),
            "ratio_stdev": statistics.stdev(ratios) if len(ratios) > 1 else 0.0,
            "workers_ratio_median": statistics.median(r["workers_ratio"] for r in results),
            "wall_ratio_median": statistics.median(r["wall_ratio"] for r in results),
            "launcher_extra_share": extra["launcher"], "spare_share": extra["spare"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="5m", choices=("tiny", "1m", "5m"), help="example preset (default: 5m)")
    p.add_argument("--steps", type=int, default=120, help="steps per job (default: 120)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, alternating which job starts first (default: 3)")
    p.add_argument("--warmup", type=int, default=10, help="steps left out at the start (default: 10)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--observe", action="store_true",
                   help="run hotspare with --metrics (scraped every second) and --events on (docs/OBSERVABILITY.md)")
    p.add_argument("--sharded", choices=("fsdp", "hsdp"),
                   help="run the example sharded (FSDP2, or 2 x 2 HSDP): hotspare's buddy snapshots and step gate "
                        "against torchrun's plain FSDP2 (docs/SHARDED.md)")
    args = p.parse_args()
    SCRIPT_EXTRA[:] = [f"--{args.sharded}"] if args.sharded else []
    if args.steps < args.warmup + 10:
        p.error(f"--steps must be at least --warmup + 10 = {args.warmup + 10}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    print(f"model {args.model}, torchrun and hotspare{' (metrics and events on)' if args.observe else ''} side by "
          f"side, 4 ranks each (+1 spare), {os.cpu_count()} cores", flush=True)
    res = measure(args.model, args.steps, args.rounds, args.warmup, observe=args.observe)
    print(f"hotspare / torchrun CPU per step: median {res['ratio_median']:.4f}, mean {res['ratio_mean']:.4f} "
          f"+- {res['ratio_stdev']:.4f} (sd over {args.rounds} rounds)   target < 1.005")
    print(f"   of which: workers {res['workers_ratio_median']:.4f}; hotspare's launcher beyond torchrun's "
          f"{100 * res['launcher_extra_share']:+.3f}% and its spare {100 * res['spare_share']:.3f}% of torchrun's CPU per step")
    print(f"   wall time per step (the two sharing the cores): median ratio {res['wall_ratio_median']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
