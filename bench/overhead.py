"""Steady-state overhead of hotspare against plain torchrun, the two jobs running side by side.

    python bench/overhead.py                          # 5M model, 4 ranks each, 3 rounds (~13 min)
    python bench/overhead.py --model 1m --steps 300   # quicker
    python bench/overhead.py --observe                # three jobs: torchrun, hotspare, and hotspare with
                                                      # --metrics (scraped every second), --events and
                                                      # --dashboard (a logged-in page following it) on
    python bench/overhead.py --model 1m --sharded fsdp  # FSDP2 under hotspare with buddy snapshots on,
                                                        # the same with them off, and torchrun's FSDP2
    PYTHONPATH=/path/to/other/checkout python bench/overhead.py   # measure another hotspare

Run one after the other, the two jobs meet different machines: on a shared 2-core VM the step
time drifts by a few percent from minute to minute, more than the effect being measured. So here
they run at the same time, on the same cores, with the same script and arguments: whatever the
machine does meanwhile (other tenants, clock, cache pressure) hits both alike. Each job's cost is
its CPU time per step over the window in which both are in steady state: the CPU of every
process of the job (launcher, workers, the spare, all their threads: /proc's schedstat), between
two of its own step lines, over the steps between. Start-up and shutdown fall outside the window.
The ratio hotspare / torchrun is computed per round; the rounds alternate which job starts first.

``--observe`` adds a third job beside the two: hotspare with everything docs/OBSERVABILITY.md
describes switched on and in use, as an operator would have it: ``--metrics`` scraped every second
(as Prometheus would), ``--events`` written, and ``--dashboard`` with a logged-in client following
its live stream (as an open browser tab would). Its ratios against torchrun and against the plain
hotspare job of the same round are the cost of watching a job; the three rotate which starts first.

``--sharded fsdp|hsdp`` runs the example sharded and adds a third job beside torchrun's and
hotspare's: hotspare with its buddy snapshots and gradient logs off (``HOTSPARE_SNAPSHOT_EVERY=0``;
the step gate, its pause vote and the per-rank rows stay), so the snapshots' own cost is the ratio
of the two hotspare jobs, measured side by side; with each job's workers' resident memory (the
mean over its ranks of the peak VmRSS seen at a step line) and the host RAM the snapshots take as
the runtime counts it.

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
NOSNAP = "hotspare-nosnap"        # --sharded: hotspare with the buddy snapshots off
SNAP_RAM = re.compile(r"about ([\d.]+) MB of host RAM per rank")


def _tasks_cpu_s(pid: int) -> dict[str, float]:
    """On-CPU time of each thread of ``pid`` by kind (``schedstat``: nanoseconds, not 10 ms
    ticks): "main" (the process's first thread), else the thread's name (``comm``)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            if int(tid) == pid:
                kind = "main"
            else:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    kind = f.read().strip()
        except OSError:
            # a thread that ended while it was listed: skipped alone (letting the error reach
            # tree_cpu_s dropped the whole process from that sample: a round of 2026-12-06 counted
            # three ranks of four at its end and read 0.64)
            if int(tid) == pid:
                raise
            continue
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


def _sharded() -> bool:
    return "--fsdp" in SCRIPT_EXTRA or "--hsdp" in SCRIPT_EXTRA


def worker_rss_mb(root: int) -> list[float]:
    """Resident memory (VmRSS) of each training rank below ``root``, in MB."""
    out = []
    for pid in descendants(root):
        try:
            if _role(pid) != "worker":
                continue
            with open(f"/proc/{pid}/status") as f:
                out += [int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:")]
        except OSError:
            pass
    return out


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
    """One job started in the background; records (step, CPU of its tree) at each step line and
    hands every line to ``on_line`` (None: no one)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], on_line=None):
        self.name, self.points, self.tail, self.on_line = name, [], [], on_line
        self.rss: list[float] = []       # the peak VmRSS of each rank seen so far (MB)
        self.snap_ram_mb: float | None = None
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
                if _sharded() and int(m.group(1)) % 5 == 0:
                    rss = worker_rss_mb(self.proc.pid)
                    self.rss = [max(a, b) for a, b in zip(self.rss, rss)] if len(rss) == len(self.rss) else rss
            ram = SNAP_RAM.search(line)
            if ram:
                self.snap_ram_mb = float(ram.group(1))
            if self.on_line is not None:
                self.on_line(line)

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


OBSERVED = "hotspare+observe"


def commands(model: str, steps: int, port: int, observe: tuple[int, str] | None = None) -> dict[str, list[str]]:
    """``observe``: (metrics port, events file) to add a third job, hotspare with --metrics,
    --events and --dashboard on."""
    script = [str(EXAMPLE), "--model", model, "--steps", str(steps), *SCRIPT_EXTRA]
    hotspare = [sys.executable, "-m", "hotspare", "run", "--nproc", "4", "--spares", "1", "--log-every", "1"]
    out = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                     "--master-port", str(port), *script],
        "hotspare": [*hotspare, "--", *script],
    }
    if _sharded():
        out[NOSNAP] = out["hotspare"]
    if observe is not None:
        out[OBSERVED] = [*hotspare, "--metrics", f"127.0.0.1:{observe[0]}", "--events", observe[1],
                         "--dashboard", "127.0.0.1:0", "--", *script]
    return out


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


class Viewer:
    """An open dashboard tab: once the job logs its dashboard (``dashboard: http://ADDR/ (...
    token in FILE)``), logs in with the token and follows ``/events`` until the job ends;
    counts the records it received."""

    LINE = re.compile(r"dashboard: http://(\S+?)/ .*token in (\S+)\)")

    def __init__(self):
        self.records, self.error = 0, None
        self._thread: threading.Thread | None = None

    def __call__(self, line: str) -> None:
        m = self.LINE.search(line)
        if m and self._thread is None:
            self._thread = threading.Thread(target=self._follow, args=m.groups(), daemon=True)
            self._thread.start()

    def _follow(self, address: str, token_file: str) -> None:
        import http.client
        import urllib.parse
        try:
            host, port = address.rsplit(":", 1)
            with open(token_file) as f:
                token = f.read().strip()
            conn = http.client.HTTPConnection(host, int(port), timeout=10)
            conn.request("POST", "/login", urllib.parse.urlencode({"token": token}),
                         {"Content-Type": "application/x-www-form-urlencoded"})
            r = conn.getresponse()
            r.read()
            cookie = (r.getheader("Set-Cookie") or "").split(";")[0]
            if r.status != 303 or not cookie:
                raise RuntimeError(f"login answered {r.status}")
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            conn.request("GET", "/events", headers={"Cookie": cookie})
            stream = conn.getresponse()
            for raw in stream.fp:
                self.records += raw.startswith(b"data: ")
        except (OSError, RuntimeError, ValueError) as e:
            if not self.records:        # a stream cut when the job ends is the normal end
                self.error = f"{type(e).__name__}: {e}"

    def stop(self) -> int:
        if self._thread is not None:
            self._thread.join(10)
        return self.records


def one_round(model: str, steps: int, warmup: int, order: list[str], port: int, observe: bool = False) -> dict:
    """One round: the jobs of ``commands`` side by side, started in ``order``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "HOTSPARE_LOG_EVERY_S": "0"}   # torchrun's rank 0 prints every step: the window's marks
    import tempfile
    tmp = tempfile.mkdtemp(prefix="overhead-")
    metrics_port = free_port() if observe else 0
    cmds = commands(model, steps, port, (metrics_port, os.path.join(tmp, "events.jsonl")) if observe else None)
    viewer = Viewer() if observe else None
    envs = {n: {**env, "HOTSPARE_SNAPSHOT_EVERY": "0"} if n == NOSNAP else env for n in order}
    jobs = {n: Job(n, cmds[n], envs[n], viewer if n == OBSERVED else None) for n in order if n in cmds}
    scraper = Scraper(metrics_port) if observe else None
    for job in jobs.values():
        code = job.wait(3600)
        if code != 0:
            raise RuntimeError(f"{job.name} exited with {code}:\n{''.join(job.tail)}")
    scrapes = scraper.stop() if scraper is not None else None
    # The common steady-state window: every job past warm-up, none in its last steps yet.
    start = max(next(t for t, s, _ in j.points if s >= warmup) for j in jobs.values())
    end = min(next(t for t, s, _ in j.points if s >= steps - 3) for j in jobs.values())
    out = {"first": order[0], "window_s": end - start, "observed": observe, "scrapes": scrapes,
           "dashboard_records": viewer.stop() if viewer else None, "dashboard_error": viewer.error if viewer else None}
    for n, j in jobs.items():
        out[n], out[f"{n}_steps"] = per_step(j.points, start, end)
        out[f"{n}_rss_mb"] = statistics.mean(j.rss) if j.rss else None
        out[f"{n}_snap_ram_mb"] = j.snap_ram_mb
    return _ratios(out, jobs)


def alone_round(model: str, steps: int, warmup: int, order: list[str], observe: bool = False) -> dict:
    """One round with the jobs one after another, each alone on the cores (``--alone``)."""
    out: dict = {"first": order[0], "window_s": 0.0, "observed": observe, "scrapes": None,
                 "dashboard_records": None, "dashboard_error": None}
    for n in order:
        res = one_round(model, steps, warmup, [n], free_port(), observe)
        out["window_s"] += res["window_s"]
        out.update({k: v for k, v in res.items() if k == n or k.startswith(f"{n}_")})
    return _ratios(out, [n for n in order])


def _ratios(out: dict, jobs) -> dict:
    for n, base in (("hotspare", "torchrun"), (OBSERVED, "torchrun"), (OBSERVED, "hotspare"),
                    (NOSNAP, "torchrun"), ("hotspare", NOSNAP)):
        if n in jobs and base in jobs:
            key = "" if (n, base) == ("hotspare", "torchrun") else f"{n}/{base}:"
            out[f"{key}ratio"] = out[n]["all"] / out[base]["all"]
            out[f"{key}workers_ratio"] = out[n]["worker"] / out[base]["worker"]
            out[f"{key}wall_ratio"] = out[n]["wall"] / out[base]["wall"]
    return out


def measure(model: str = "5m", steps: int = 120, rounds: int = 3, warmup: int = 10, say=print,
            observe: bool = False, alone: bool = False) -> dict:
    results = []
    names = ["torchrun", "hotspare"] + ([OBSERVED] if observe else []) + ([NOSNAP] if _sharded() else [])
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        res = (alone_round(model, steps, warmup, order, observe) if alone
               else one_round(model, steps, warmup, order, free_port(), observe))
        results.append(res)
        t, h = res["torchrun"], res["hotspare"]
        say(f"   round {r + 1}: CPU per step, torchrun {1000 * t['all']:7.1f} ms ({res['torchrun_steps']} steps), "
            f"hotspare {1000 * h['all']:7.1f} ms ({res['hotspare_steps']} steps): ratio {res['ratio']:.4f}   "
            f"[{order[0]} started first, window {res['window_s']:.0f} s]")
        say(f"      workers {1000 * t['worker']:7.1f} / {1000 * h['worker']:7.1f} ms (ratio {res['workers_ratio']:.4f})"
            f"   launcher {1000 * t['launcher']:5.2f} / {1000 * h['launcher']:5.2f} ms   spare {1000 * h['spare']:5.2f} ms"
            f"   wall/step {1000 * t['wall']:6.1f} / {1000 * h['wall']:6.1f} ms (ratio {res['wall_ratio']:.4f})")
        if observe:
            o, k = res[OBSERVED], f"{OBSERVED}/hotspare:"
            say(f"      {OBSERVED} {1000 * o['all']:7.1f} ms ({res[OBSERVED + '_steps']} steps): ratio to torchrun "
                f"{res[OBSERVED + '/torchrun:ratio']:.4f}, to hotspare {res[k + 'ratio']:.4f} (workers "
                f"{res[k + 'workers_ratio']:.4f}, launcher {1000 * o['launcher']:5.2f} ms, wall "
                f"{res[k + 'wall_ratio']:.4f}); {res['scrapes']} scrapes of /metrics, {res['dashboard_records']} "
                f"records to the dashboard's viewer"
                + (f" ({res['dashboard_error']})" if res["dashboard_error"] else ""))
        if _sharded():
            k, o = f"hotspare/{NOSNAP}:", res[NOSNAP]
            say(f"      {NOSNAP} {1000 * o['all']:7.1f} ms: snapshots on / off {res[k + 'ratio']:.4f} (workers "
                f"{res[k + 'workers_ratio']:.4f}, wall {res[k + 'wall_ratio']:.4f}); off / torchrun "
                f"{res[NOSNAP + '/torchrun:ratio']:.4f}; workers' peak RSS per rank: torchrun "
                f"{_mb(res['torchrun_rss_mb'])}, snapshots on {_mb(res['hotspare_rss_mb'])}, off "
                f"{_mb(res[NOSNAP + '_rss_mb'])}; snapshots' host RAM per rank (runtime's count) "
                f"{_mb(res['hotspare_snap_ram_mb'])}")
        kinds = sorted({k for k in (*t, *h) if k.startswith("worker/")}, key=lambda k: -h.get(k, 0.0))
        say("      workers' threads: " + ", ".join(
            f"{k[7:]} {1000 * t.get(k, 0.0):.1f} / {1000 * h.get(k, 0.0):.1f}" for k in kinds) + " ms")
    ratios = [r["ratio"] for r in results]
    base = statistics.median(r["torchrun"]["all"] for r in results)
    extra = {role: statistics.median(r["hotspare"][role] - (r["torchrun"][role] if role != "spare" else 0.0)
                                     for r in results) / base for role in ("launcher", "spare")}
    out = {"model": model, "steps": steps, "observe": observe, "rounds": results,
           "ratio_median": statistics.median(ratios), "ratio_mean": statistics.mean(ratios),
           "ratio_stdev": statistics.stdev(ratios) if len(ratios) > 1 else 0.0,
           "workers_ratio_median": statistics.median(r["workers_ratio"] for r in results),
           "wall_ratio_median": statistics.median(r["wall_ratio"] for r in results),
           "launcher_extra_share": extra["launcher"], "spare_share": extra["spare"]}
    if _sharded():
        for key in (f"hotspare/{NOSNAP}:", f"{NOSNAP}/torchrun:"):
            for what in ("ratio", "workers_ratio", "wall_ratio"):
                out[f"{key}{what}_median"] = statistics.median(r[key + what] for r in results)
            values = [r[key + "ratio"] for r in results]
            out[f"{key}ratio_stdev"] = statistics.stdev(values) if len(values) > 1 else 0.0
        for n in ("torchrun", "hotspare", NOSNAP):
            values = [r[f"{n}_rss_mb"] for r in results if r[f"{n}_rss_mb"] is not None]
            out[f"{n}_rss_mb"] = statistics.median(values) if values else None
        out["snap_ram_mb"] = results[0]["hotspare_snap_ram_mb"]
    if observe:
        for key in (f"{OBSERVED}/torchrun:", f"{OBSERVED}/hotspare:"):
            for what in ("ratio", "workers_ratio", "wall_ratio"):
                values = [r[key + what] for r in results]
                out[f"{key}{what}_median"] = statistics.median(values)
            values = [r[key + "ratio"] for r in results]
            out[f"{key}ratio_stdev"] = statistics.stdev(values) if len(values) > 1 else 0.0
        out["observe_launcher_extra_share"] = statistics.median(
            r[OBSERVED]["launcher"] - r["hotspare"]["launcher"] for r in results) / base
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="5m", choices=("tiny", "1m", "5m"), help="example preset (default: 5m)")
    p.add_argument("--steps", type=int, default=120, help="steps per job (default: 120)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, rotating which job starts first (default: 3)")
    p.add_argument("--warmup", type=int, default=10, help="steps left out at the start (default: 10)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--observe", action="store_true",
                   help="add a third job: hotspare with --metrics (scraped every second), --events and --dashboard "
                        "(a logged-in viewer following it) on (docs/OBSERVABILITY.md)")
    p.add_argument("--sharded", choices=("fsdp", "hsdp"),
                   help="run the example sharded (FSDP2, or 2 x 2 HSDP): hotspare's buddy snapshots and step gate "
                        "against torchrun's plain FSDP2 (docs/SHARDED.md)")
    p.add_argument("--batch-size", type=int, help="the example's sequences per rank per step (its default: 8)")
    p.add_argument("--alone", action="store_true",
                   help="run the jobs one after another, each alone on the cores, instead of side by side: wall "
                        "time per step then says what a job's own synchronisation costs (CPU per step is then "
                        "exposed to the machine's drift between the jobs' turns)")
    args = p.parse_args()
    SCRIPT_EXTRA[:] = [f"--{args.sharded}"] if args.sharded else []
    if args.batch_size:
        SCRIPT_EXTRA.extend(["--batch-size", str(args.batch_size)])
    if args.steps < args.warmup + 10:
        p.error(f"--steps must be at least --warmup + 10 = {args.warmup + 10}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    watched = " and hotspare with metrics, events and dashboard" if args.observe else ""
    watched += f" and hotspare with buddy snapshots off ({args.sharded})" if args.sharded else ""
    how = "one after another, each alone" if args.alone else "side by side"
    print(f"model {args.model}, torchrun and hotspare{watched} {how}, 4 ranks each (+1 spare), "
          f"{os.cpu_count()} cores", flush=True)
    res = measure(args.model, args.steps, args.rounds, args.warmup, observe=args.observe, alone=args.alone)
    print(f"hotspare / torchrun CPU per step: median {res['ratio_median']:.4f}, mean {res['ratio_mean']:.4f} "
          f"+- {res['ratio_stdev']:.4f} (sd over {args.rounds} rounds)   target < 1.005")
    print(f"   of which: workers {res['workers_ratio_median']:.4f}; hotspare's launcher beyond torchrun's "
          f"{100 * res['launcher_extra_share']:+.3f}% and its spare {100 * res['spare_share']:.3f}% of torchrun's CPU per step")
    print(f"   wall time per step ({'each job alone' if args.alone else 'the jobs sharing the cores'}): "
          f"median ratio {res['wall_ratio_median']:.4f}")
    if args.observe:
        for base in ("torchrun", "hotspare"):
            k = f"{OBSERVED}/{base}:"
            print(f"{OBSERVED} / {base} CPU per step: median {res[k + 'ratio_median']:.4f} +- "
                  f"{res[k + 'ratio_stdev']:.4f} (sd); workers {res[k + 'workers_ratio_median']:.4f}; wall "
                  f"{res[k + 'wall_ratio_median']:.4f}")
        print(f"   the observed launcher beyond the plain one: {100 * res['observe_launcher_extra_share']:+.3f}% of "
              f"torchrun's CPU per step")
    if args.sharded:
        k = f"hotspare/{NOSNAP}:"
        print(f"buddy snapshots on / off (hotspare both) CPU per step: median {res[k + 'ratio_median']:.4f} +- "
              f"{res[k + 'ratio_stdev']:.4f} (sd); workers {res[k + 'workers_ratio_median']:.4f}; wall "
              f"{res[k + 'wall_ratio_median']:.4f}   goal <= 1.02")
        print(f"   snapshots off / torchrun: {res[NOSNAP + '/torchrun:ratio_median']:.4f}; workers' peak RSS per "
              f"rank: torchrun {_mb(res['torchrun_rss_mb'])}, snapshots on {_mb(res['hotspare_rss_mb'])}, off "
              f"{_mb(res[NOSNAP + '_rss_mb'])}; the snapshots' host RAM per rank as the runtime counts it "
              f"{_mb(res['snap_ram_mb'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


def _mb(v: float | None) -> str:
    return "?" if v is None else f"{v:.1f} MB"


if __name__ == "__main__":
    main()
