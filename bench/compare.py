"""Job completion under failures, side by side: hotspare vs checkpoint-restart vs TorchFT.

    python bench/compare.py                       # both scenarios below (8.5-14 min on 2 cores)
    python bench/compare.py --quick               # main scenario only, 40 steps, 1 failure (~1.5-3 min)
    python bench/compare.py --plot docs/compare-progress.png --json compare.json

The same training job (examples/gpt_stdlib.py's GPT, 4 data-parallel ranks, CPU/gloo) runs for the
same number of steps under the same failure schedule (a real SIGKILL of the process holding a
given rank at given wall-clock offsets from launch, seeded), one system after the other:

  hotspare        hotspare run --nproc 4 --spares 1 (warm spare, state from a live peer)
  ckpt-legacy     torchrun --max-restarts with a torch.distributed.checkpoint save every K steps
                  (K long and fixed: --legacy-every, default 100, Clockwork's interval), reloading
                  the newest checkpoint after every restart (bench/peers/ckpt_restart.py)
  ckpt-yd         the same with K from Young/Daly for the measured checkpoint cost and failure rate
  torchft         torchft 0.2.0: lighthouse + one replica group per rank, each under its own
                  torchrun --max_restarts, live recovery from a peer (bench/peers/torchft_train.py)

Scenarios:
  main     the example's 1M-parameter GPT, --steps steps, --failures failures spread over the
           fault-free run's training time (every system gets exactly those failures);
  replica  a scaled-down replica of Clockwork's published run (3,000 steps, failures every
           2,700-4,500 s, a checkpoint every 100 steps; 405 : 818 : 930 minutes for TorchPass :
           checkpoint-restart : TorchFT): the failure gaps are drawn from the same range
           expressed in step times (2,700-4,500 s over Clockwork's ~8.1 s step, --clockwork-step-s)
           and multiplied by this machine's measured step time, and failures keep arriving for
           as long as a system runs, so a slower system meets more of them, as in theirs.

Before the faulty runs, two fault-free runs give the references: plain DDP under torchrun (the
ideal completion time and step time; the reference digest for checkpoint-restart) and hotspare
(the reference digest for hotspare). Reported per system: job completion time (JCT) and
hotspare/other ratios (the headline: absolute times are context, this machine is noisy), time
lost per failure (kill to the first step beyond the step reached at the kill, minus one step),
steps recomputed, batches trained, worker-seconds wasted (4 x JCT minus the batches trained at the
ideal step time; each CPU worker stands in for a GPU) and, for hotspare, the idle spare's
worker-seconds; final loss; and whether the final model is bit for bit the fault-free one.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hotspare.cli.progress import Progress  # noqa: E402
from hotspare.sim.failure_math import daly_interval  # noqa: E402
from procs import alive, descendants, environ, free_port, started_at  # noqa: E402

EXAMPLE = REPO / "examples" / "gpt_stdlib.py"
PEER_CKPT = REPO / "bench" / "peers" / "ckpt_restart.py"
PEER_TORCHFT = REPO / "bench" / "peers" / "torchft_train.py"
WORLD = 4
SYSTEMS = ("hotspare", "ckpt-legacy", "ckpt-yd", "torchft")

# Clockwork's published run: TorchTitan Llama-4 Scout (109B), 64 H200, 3,000 steps, a checkpoint
# every 100 steps, failures injected every 2,700-4,500 s.
CLOCKWORK = {"steps": 3000, "gap_s": (2700.0, 4500.0), "ckpt_every": 100,
             "jct_min": {"hotspare": 405, "ckpt": 818, "torchft": 930}}

STEP_HOTSPARE = re.compile(r"\]\s+step\s+(\d+)/\d+\s+loss\s+(\S+)")
START_HOTSPARE = re.compile(r"START\s+generation \d+: ranks \S+ on workers ([\w,]+)")
RESUMED_HOTSPARE = re.compile(r"RESUMED rank (\d+) -> (\w+)")
RECOVER_HOTSPARE = re.compile(r"RECOVER\s+generation \d+: .*?replaces? ranks? \[([\d, ]+)\]")
STEP_PLAIN = re.compile(r"^step (\d+) loss (\S+)")
CKPT_SAVED = re.compile(r"^\[ckpt\] saved step-(\d+) in ([\d.]+) s")
CKPT_LOADED = re.compile(r"^\[ckpt\] restart (\d+): loaded step-\d+ \(resume at step (\d+)\) in ([\d.]+) s")
CKPT_NONE = re.compile(r"^\[ckpt\] restart (\d+): no complete checkpoint")


# ----------------------------------------------------------------------------------- processes
def kill_tree(root: int) -> None:
    for pid in [root, *descendants(root)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ----------------------------------------------------------------------------------- schedules
@dataclass
class Kill:
    rank: int
    at_s: float | None = None     # wall-clock offset from the launch of the system, or
    at_step: int | None = None    # the moment the job first reports this step committed,
    delay_s: float = 0.0          # plus this much (lands the kill inside the next step)

    def __str__(self) -> str:
        if self.at_step is not None:
            return f"rank {self.rank} {1000 * self.delay_s:.0f} ms after step {self.at_step}"
        return f"rank {self.rank} at {self.at_s:.1f} s"


@dataclass
class Schedule:
    kills: list[Kill]
    mtbf_s: float         # mean time between failures the schedule stands for
    how: str

    def describe(self) -> str:
        return ", ".join(map(str, self.kills))


def spread_schedule(n: int, steps: int, step_s: float, seed: int) -> Schedule:
    """``n`` failures spread over the job: failure i strikes once the job first commits a step
    drawn from the middle half of the i-th of n equal slices of the steps, a random fraction of
    a step later (so it lands in forward, backward or the gradient exchange); ranks at random.
    Tied to progress, not to the clock, so every system meets exactly these failures however
    fast this shared machine lets it run."""
    rng = random.Random(seed)
    slot = steps / n
    kills = [Kill(rng.randrange(WORLD), at_step=int(slot * (i + rng.uniform(0.25, 0.75))),
                  delay_s=rng.uniform(0.0, 1.0) * step_s) for i in range(n)]
    return Schedule(kills, slot * step_s, f"{n} failure(s), one in each {slot:.0f}-step slice, seed {seed}")


def renewal_schedule(gap_lo: float, gap_hi: float, horizon_s: float, seed: int) -> Schedule:
    """Failures every U(gap_lo, gap_hi) seconds from launch until ``horizon_s``."""
    rng = random.Random(seed)
    kills, t = [], 0.0
    while True:
        t += rng.uniform(gap_lo, gap_hi)
        if t > horizon_s:
            break
        kills.append(Kill(rng.randrange(WORLD), at_s=t))
    return Schedule(kills, (gap_lo + gap_hi) / 2, f"a failure every {gap_lo:.1f}-{gap_hi:.1f} s "
                                                   f"(uniform), from launch on, seed {seed}")


# ----------------------------------------------------------------------------------- systems
class System:
    """How to launch one system, read its output, and find the process holding a rank."""

    name = ""
    single_reporter = True

    def __init__(self, label: str, workdir: Path, env: dict[str, str]) -> None:
        self.label, self.workdir, self.env = label, workdir, env
        self.roots: list[subprocess.Popen] = []
        self.extra: dict[str, Any] = {}

    def commands(self) -> list[tuple[str, list[str], dict[str, str]]]:
        raise NotImplementedError

    def on_line(self, source: str, line: str, t: float) -> tuple[int, float] | None:
        """Parse one output line; return (step, loss) when it reports a committed step."""
        m = STEP_PLAIN.match(line)
        return (int(m.group(1)), _float(m.group(2))) if m else None

    def holder(self, rank: int) -> int | None:
        raise NotImplementedError

    def after_kill(self, pid: int) -> None:
        """Called right after a SIGKILL was sent to ``pid``."""

    def collect(self) -> None:
        """Read result files once the run is over."""

    def workers(self, root: subprocess.Popen) -> list[int]:
        return [p for p in descendants(root.pid) if alive(p) and "TORCHELASTIC_RESTART_COUNT" in environ(p)]


def _float(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


class Hotspare(System):
    name = "hotspare"

    def __init__(self, label, workdir, env, script_args: list[str]) -> None:
        super().__init__(label, workdir, env)
        self.script_args = script_args
        self.report = workdir / f"{label}-report.json"
        self.members: dict[int, str] = {}      # rank -> worker id, from the launcher's log
        self.pids: dict[str, int] = {}

    def commands(self):
        return [("launcher", [sys.executable, "-m", "hotspare", "run", "--nproc", str(WORLD), "--spares", "1",
                              "--report", str(self.report), "--log-every", "1", "--", str(EXAMPLE),
                              *self.script_args], {})]

    def on_line(self, source, line, t):
        if m := START_HOTSPARE.search(line):
            self.members = dict(enumerate(m.group(1).split(",")))
        elif m := RECOVER_HOTSPARE.search(line):
            # The log names the replaced ranks, not the spares taking them: a rank goes to the
            # oldest live spare not holding a rank yet (the launcher hands out ready spares in
            # order). A RESUMED line, when one comes, names the worker and overrides this.
            for rank in (int(x) for x in m.group(1).replace(" ", "").split(",") if x):
                held = set(self.members.values())
                spares = sorted((int(w[1:]), w) for p in descendants(self.roots[0].pid) if alive(p)
                                for w in [environ(p).get("HOTSPARE_WORKER_ID", "")]
                                if w.startswith("w") and w[1:].isdigit() and w not in held
                                and environ(p).get("HOTSPARE_ROLE") == "spare")
                if spares:
                    self.members[rank] = spares[0][1]
                else:
                    self.members.pop(rank, None)
        elif m := RESUMED_HOTSPARE.search(line):
            self.members[int(m.group(1))] = m.group(2)
        elif m := STEP_HOTSPARE.search(line):
            return int(m.group(1)), _float(m.group(2))
        return None

    def holder(self, rank):
        worker = self.members.get(rank)
        if worker is None:
            return None
        pid = self.pids.get(worker)
        if pid is None:
            for p in descendants(self.roots[0].pid):
                if environ(p).get("HOTSPARE_WORKER_ID") == worker:
                    self.pids[worker] = pid = p
                    break
        return pid if pid is not None and alive(pid) else None

    def collect(self):
        if self.report.exists():
            r = json.loads(self.report.read_text())
            self.extra.update(digest=r.get("final_state_digest"), steps_lost=r.get("steps_lost"),
                              steps_repeated=r.get("steps_repeated"),
                              downtime_s=[f.get("downtime_s") for f in r.get("failures", [])],
                              recovered_zero_loss=r.get("recovered_zero_loss"),
                              failures_seen=r.get("failures_total"))


class Torchrun(System):
    """Plain DDP or checkpoint-restart: bench/peers/ckpt_restart.py under torchrun --max-restarts."""

    name = "checkpoint-restart"

    pin_buckets = False    # set from --ckpt-pin-buckets

    def __init__(self, label, workdir, env, script_args: list[str], every: int) -> None:
        super().__init__(label, workdir, env)
        self.script_args, self.every = script_args, every
        self.stats = workdir / f"{label}-stats.json"
        self.ckpt_dir = workdir / f"{label}-ckpt"
        self.extra.update(save_s=[], loads=[], ckpt_every=every)
        self.doomed: set[int] = set()

    def commands(self):
        port = free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(WORLD),
               "--max-restarts", "100", "--rdzv-id", f"compare-{self.label}", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", str(PEER_CKPT), *self.script_args,
               "--stats", str(self.stats)]
        if self.every:
            cmd += ["--ckpt-dir", str(self.ckpt_dir), "--ckpt-every", str(self.every)]
        if self.pin_buckets:
            cmd += ["--pin-buckets"]
        return [("torchrun", cmd, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})]

    def on_line(self, source, line, t):
        if m := CKPT_SAVED.match(line):
            self.extra["save_s"].append(float(m.group(2)))
        elif m := CKPT_LOADED.match(line):
            self.extra["loads"].append({"t": t, "resume_step": int(m.group(2)), "load_s": float(m.group(3))})
        elif CKPT_NONE.match(line):
            self.extra["loads"].append({"t": t, "resume_step": 0, "load_s": 0.0})
        return super().on_line(source, line, t)

    def holder(self, rank):
        for p in self.workers(self.roots[0]):
            if p not in self.doomed and environ(p).get("RANK") == str(rank):
                return p
        return None

    def after_kill(self, pid):
        # torchrun answers a lost worker by stopping all of them and starting a new set: the
        # workers alive now are being torn down, the next failure must hit the new ones.
        self.doomed.update(self.workers(self.roots[0]))
        self.doomed.add(pid)

    def collect(self):
        if self.stats.exists():
            s = json.loads(self.stats.read_text())
            self.extra.update(digest=s["digest"], final_loss_stats=s["final_loss"])


class TorchFT(System):
    name = "torchft"
    single_reporter = False

    def __init__(self, label, workdir, env, script_args: list[str]) -> None:
        super().__init__(label, workdir, env)
        self.script_args = script_args
        self.stats = str(workdir / f"{label}-stats-REPLICA.json")
        self.lighthouse: subprocess.Popen | None = None

    def start_infrastructure(self, log) -> None:
        self.lh_port = free_port()
        # The lighthouse command of torchft's README and torchtitan's torchft guide.
        cmd = ["torchft_lighthouse", "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
               "--bind", f"[::]:{self.lh_port}"]
        self.extra["lighthouse"] = " ".join(cmd)
        self.lighthouse = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                           env=self.env)
        deadline = time.time() + 10
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.lh_port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("torchft_lighthouse did not start listening within 10 s")

    def stop_infrastructure(self) -> None:
        if self.lighthouse is not None:
            kill_tree(self.lighthouse.pid)
            self.lighthouse.wait()

    def commands(self):
        out = []
        for i in range(WORLD):
            # torchft/torchx.py's replica-group launch: its own torchrun, --max_restarts.
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--master_port={free_port()}", "--nnodes=1",
                   "--nproc_per_node=1", "--max_restarts=100", str(PEER_TORCHFT), *self.script_args,
                   "--stats", self.stats]
            env = {"REPLICA_GROUP_ID": str(i), "NUM_REPLICA_GROUPS": str(WORLD),
                   "TORCHFT_LIGHTHOUSE": f"http://localhost:{self.lh_port}",
                   # torchft's Rust side logs ~7 INFO lines per step and replica; keep warnings only.
                   "RUST_LOG": "warn"}
            out.append((f"replica{i}", cmd, env))
        return out

    def holder(self, rank):
        workers = self.workers(self.roots[rank])
        return max(workers, key=lambda p: started_at(p) or 0.0) if workers else None

    def collect(self):
        reps = []
        for i in range(WORLD):
            p = Path(self.stats.replace("REPLICA", str(i)))
            if p.exists():
                reps.append(json.loads(p.read_text()))
        if reps:
            self.extra.update(batches_committed=reps[0]["batches_committed"],
                              failed_commits=sum(r["failed_commits"] for r in reps),
                              replicas_consistent=len({r["digest"] for r in reps}) == 1,
                              digest=reps[0]["digest"], final_loss_stats=reps[0]["final_loss"],
                              replica_restarts=[r["restarts"] for r in reps])


# ----------------------------------------------------------------------------------- a run
@dataclass
class Run:
    system: str
    label: str
    commands: list[str]
    steps: int
    ok: bool = False
    jct_s: float = 0.0
    progress: list[tuple[float, int]] = field(default_factory=list)   # (t, step) as reported
    losses: list[float | None] = field(default_factory=list)
    kills: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    log: str = ""
    error: str = ""


def execute(sysm: System, steps: int, schedule: Schedule | None, timeout: float, say: Callable[[str], None]) -> Run:
    """Launch a system, inject the schedule's SIGKILLs, follow its progress until it exits."""
    log_path = sysm.workdir / f"{sysm.label}.log"
    log = open(log_path, "w")
    run = Run(sysm.name, sysm.label, [], steps, log=str(log_path))
    lock = threading.Lock()
    best = {"step": -1}
    per_source_max: dict[str, int] = {}
    if isinstance(sysm, TorchFT):
        sysm.start_infrastructure(log)
    t0 = time.time()

    def reader(source: str, stream) -> None:
        for raw in stream:
            t = time.time() - t0
            line = raw.rstrip("\n")
            log.write(f"{t:9.3f} {source}: {line}\n")
            with lock:
                hit = sysm.on_line(source, line, t)
                if hit is None:
                    continue
                step, loss = hit
                if sysm.single_reporter:
                    run.progress.append((t, step))
                    run.losses.append(loss)
                else:   # TorchFT: the job is as far as its most advanced replica
                    per_source_max[source] = max(per_source_max.get(source, -1), step)
                    if step > best["step"]:
                        run.progress.append((t, step))
                        run.losses.append(loss)
                    if source == "replica0" and step == steps - 1:
                        run.extra["final_loss_replica0"] = loss
                best["step"] = max(best["step"], step)

    procs = []
    for source, cmd, env in sysm.commands():
        full_env = {**sysm.env, **env}
        run.commands.append(" ".join(f"{k}={v}" for k, v in env.items()) + (" " if env else "") + " ".join(cmd))
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                             env=full_env, cwd=REPO, start_new_session=True)
        procs.append(p)
        threading.Thread(target=reader, args=(source, p.stdout), daemon=True).start()
    sysm.roots = procs
    done = threading.Event()

    def killer() -> None:
        for k in sorted(schedule.kills if schedule else [],
                        key=lambda k: k.at_step if k.at_step is not None else k.at_s):
            if k.at_step is not None:
                while best["step"] < k.at_step and not done.is_set():
                    time.sleep(0.002)
                due = time.time() + k.delay_s
            else:
                due = t0 + k.at_s
            if done.wait(max(0.0, due - time.time())):
                if k.at_step is None:
                    break           # the run ended before this failure's time: so do the later ones
                run.kills.append({**asdict(k), "fired": False})
                continue
            pid = None
            while not done.is_set():
                pid = sysm.holder(k.rank)
                if pid is not None:
                    break
                time.sleep(0.02)
            if pid is None:
                run.kills.append({**asdict(k), "fired": False})
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            now = time.time()
            sysm.after_kill(pid)
            with lock:
                at_step = best["step"]
            run.kills.append({**asdict(k), "fired_s": round(now - t0, 3), "pid": pid, "fired": True,
                              "job_step": at_step})
            say(f"      {now - t0:7.1f} s  SIGKILL rank {k.rank} (pid {pid}), job at step {at_step}")

    kt = threading.Thread(target=killer, daemon=True)
    kt.start()
    last_note = time.time()
    try:
        while any(p.poll() is None for p in procs):
            time.sleep(0.1)
            now = time.time()
            if now - t0 > timeout:
                run.error = f"timed out after {timeout:.0f} s"
                break
            if now - last_note >= 15:
                last_note = now
                fired = sum(1 for k in run.kills if k.get("fired"))
                say(f"      {now - t0:7.1f} s  step {best['step'] + 1}/{steps}, {fired} failure(s) so far")
        run.jct_s = time.time() - t0
    finally:
        done.set()
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
            p.wait()
        if isinstance(sysm, TorchFT):
            sysm.stop_infrastructure()
        kt.join(2)
        time.sleep(0.2)      # let the readers drain
        log.close()
    codes = [p.returncode for p in procs]
    sysm.collect()
    run.extra.update(sysm.extra)
    run.ok = not run.error and all(c == 0 for c in codes) and best["step"] >= steps - 1
    if not run.ok and not run.error:
        run.error = f"exit codes {codes}, last step {best['step']}"
    return run


# ----------------------------------------------------------------------------------- metrics
def median_step(run: Run) -> float | None:
    """Median time between consecutive committed steps (the system's steady step time)."""
    diffs = [b[0] - a[0] for a, b in zip(run.progress, run.progress[1:]) if b[1] == a[1] + 1]
    return statistics.median(diffs) if diffs else None


def first_step_s(run: Run) -> float:
    return run.progress[0][0] if run.progress else 0.0


def lost_per_failure(run: Run, ahead: int = 5) -> list[float]:
    """For each fired kill at job step s: the time from the kill until the job first commits step
    s + ``ahead``, less the time those steps take at the run's steady step time. Looking a few
    steps ahead, not one, counts the stall even where a step in flight still commits after the
    kill (a TorchFT peer that had already contributed), and the slow first steps after a restart.
    When the next failure comes first, the window ends there (less the new steps made by then)."""
    step_s = median_step(run) or 0.0
    fired = sorted((k["fired_s"], k["job_step"]) for k in run.kills if k.get("fired"))
    out = []
    for i, (tk, s) in enumerate(fired):
        target = min(s + ahead, run.steps - 1)
        back = next((t for t, st in run.progress if t > tk and st >= target), run.jct_s)
        end = min(back, fired[i + 1][0]) if i + 1 < len(fired) else back
        reached = max([st for t, st in run.progress if t <= end] + [s])
        out.append(max(0.0, end - tk - max(0, reached - s) * step_s))
    return out


def steps_recomputed(run: Run) -> int:
    """Committed steps that were committed again later (work thrown away and redone)."""
    seen, n = set(), 0
    for _, s in run.progress:
        n += s in seen
        seen.add(s)
    return n


def summarize(run: Run, ideal_step_s: float, ref_digest: str | None, spares: int) -> dict[str, Any]:
    batches = run.extra.get("batches_committed", WORLD * run.steps)
    lost = lost_per_failure(run)
    digest = run.extra.get("digest")
    final_loss = run.extra.get("final_loss_replica0") if run.system == "torchft" else \
        (run.losses[-1] if run.losses else None)
    own_step = median_step(run)
    out = {
        "system": run.system, "label": run.label, "ok": run.ok, "error": run.error,
        "jct_s": round(run.jct_s, 2),
        # the same run with its steady steps at the ideal step time: takes this machine's load
        # swings out (and each system's own per-step overhead with them)
        "jct_at_ideal_step_s": (round(run.jct_s - run.steps * (own_step - ideal_step_s), 2)
                                if own_step else None),
        "failures": sum(1 for k in run.kills if k.get("fired")),
        "lost_per_failure_s": [round(x, 2) for x in lost],
        "mean_lost_per_failure_s": round(statistics.mean(lost), 2) if lost else None,
        "steps_recomputed": steps_recomputed(run),
        "batches_trained": batches, "batches_scheduled": WORLD * run.steps,
        "wasted_worker_s": round(WORLD * run.jct_s - batches * ideal_step_s, 1),
        "idle_spare_worker_s": round(spares * run.jct_s, 1),
        "median_step_s": own_step, "startup_s": round(first_step_s(run), 2),
        "final_loss": final_loss, "digest": digest,
        "equals_fault_free": (None if ref_digest is None or run.system == "torchft"
                              else bool(digest) and digest == ref_digest),
        "kills": run.kills, "commands": run.commands, "log": run.log,
        "extra": {k: v for k, v in run.extra.items() if k not in ("digest",)},
        "progress": [(round(t, 3), s) for t, s in run.progress],
    }
    return out


# ----------------------------------------------------------------------------------- scenarios
def planned_runs(args: argparse.Namespace) -> int:
    """The jobs ``main`` will start, for its progress line: each scenario's references or probe
    and one job per system (the Young/Daly cost probe only when no legacy run can measure it;
    when it is needed anyway the total grows)."""
    n = 0
    if not args.replica_only:
        n += 1 + ("hotspare" in args.systems) + len(args.systems)
        n += "ckpt-yd" in args.systems and args.yd_every is None and "ckpt-legacy" not in args.systems
    if not (args.quick or args.no_replica):
        n += 1 + len([s for s in args.systems if s in ("hotspare", "ckpt-legacy", "torchft")])
    return n


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workdir = Path(args.keep_logs or tempfile.mkdtemp(prefix="hotspare-compare-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.t_start = time.time()
        self.bar = Progress("compare", planned_runs(args), unit="runs")     # on stderr; closed by main

    def say(self, line: str) -> None:
        self.bar.print(f"[compare {time.time() - self.t_start:6.0f}s] {line}")

    def go(self, sysm: System, steps: int, schedule: Schedule | None, expect_s: float) -> Run:
        self.say(f"   {sysm.label}: running")
        run = execute(sysm, steps, schedule, timeout=max(120.0, 8 * expect_s), say=self.say)
        self.bar.advance()
        status = "ok" if run.ok else f"FAILED: {run.error} (log: {run.log})"
        self.say(f"   {sysm.label}: {run.jct_s:.1f} s, {sum(1 for k in run.kills if k.get('fired'))} failure(s), "
                 f"{status}")
        return run

    def references(self, tag: str, script: list[str], steps: int, with_hotspare: bool) -> dict[str, Any]:
        self.say(f"{tag}: fault-free references")
        plain = self.go(Torchrun(f"{tag}-plain-ddp", self.workdir, self.env, script, every=0), steps, None,
                        expect_s=steps)
        if not plain.ok:
            raise SystemExit(f"the fault-free plain-DDP run failed; see {plain.log}")
        ref = {"plain": plain, "ideal_step_s": median_step(plain), "plain_digest": plain.extra.get("digest"),
               "first_step_s": first_step_s(plain)}
        if with_hotspare:
            hs = self.go(Hotspare(f"{tag}-hotspare-fault-free", self.workdir, self.env, script), steps, None,
                         expect_s=plain.jct_s)
            ref["hotspare"] = hs
            ref["hotspare_digest"] = hs.extra.get("digest") if hs.ok else None
        return ref

    def faulty(self, tag: str, script: list[str], steps: int, schedule: Schedule, systems: list[str],
               legacy_every: int, yd_every: int | None, ref: dict[str, Any]) -> dict[str, Any]:
        runs: dict[str, Run] = {}
        expect = ref["plain"].jct_s
        info: dict[str, Any] = {"legacy_every": legacy_every}
        for name in systems:
            if name == "hotspare":
                sysm: System = Hotspare(f"{tag}-hotspare", self.workdir, self.env, script)
            elif name == "ckpt-legacy":
                sysm = Torchrun(f"{tag}-ckpt-legacy", self.workdir, self.env, script, every=legacy_every)
            elif name == "ckpt-yd":
                if yd_every is None:
                    c = self.checkpoint_cost(runs, tag, script, ref)
                    tau = daly_interval(c, schedule.mtbf_s)
                    yd_every = max(1, round(tau / ref["ideal_step_s"]))
                    info.update(checkpoint_cost_s=round(c, 4), daly_interval_s=round(tau, 3))
                    self.say(f"   Young/Daly: checkpoint cost C = {c:.3f} s, MTBF M = {schedule.mtbf_s:.1f} s "
                             f"-> interval {tau:.2f} s = every {yd_every} steps")
                sysm = Torchrun(f"{tag}-ckpt-yd", self.workdir, self.env, script, every=yd_every)
            elif name == "torchft":
                sysm = TorchFT(f"{tag}-torchft", self.workdir, self.env, script)
            else:
                raise AssertionError(name)
            runs[name] = self.go(sysm, steps, schedule, expect_s=expect)
        info["yd_every"] = yd_every
        return {"runs": runs, **info}

    def checkpoint_cost(self, runs: dict[str, Run], tag: str, script: list[str], ref: dict[str, Any]) -> float:
        """C for Young/Daly: the median synchronous DCP save time, from the legacy run when it saved,
        else from a short fault-free run that saves every 5 steps."""
        saves = runs["ckpt-legacy"].extra.get("save_s") if "ckpt-legacy" in runs else None
        if not saves:
            probe = self.go(Torchrun(f"{tag}-ckpt-cost", self.workdir, self.env, script[:-2] + ["--steps", "26"],
                                     every=5), 26, None, expect_s=30)
            saves = probe.extra.get("save_s")
        if not saves:
            raise SystemExit("could not measure the checkpoint cost: no checkpoint was saved")
        return statistics.median(saves)


# ----------------------------------------------------------------------------------- reporting
COLS = ("system", "JCT s", "hs/this", "step ms", "norm JCT", "hs/norm", "fail", "lost/fail s", "recomp", "batches", "wasted w-s", "spare w-s",
        "loss", "= fault-free")


def table(rows: list[dict[str, Any]], hs_jct: float | None) -> str:
    hs_norm = next((r["jct_at_ideal_step_s"] for r in rows if r["system"] == "hotspare"), None)
    def fmt(r):
        ratio = f"{hs_jct / r['jct_s']:.2f}" if hs_jct and r["jct_s"] else "-"
        eq = {True: "yes", False: "NO", None: "n/a"}[r["equals_fault_free"]]
        step = "-" if r["median_step_s"] is None else f"{1000 * r['median_step_s']:.0f}"
        norm = r["jct_at_ideal_step_s"]
        nratio = f"{hs_norm / norm:.2f}" if hs_norm and norm else "-"
        return (r["label"].split("-", 1)[1], f"{r['jct_s']:.1f}", ratio, step,
                "-" if norm is None else f"{norm:.1f}", nratio, str(r["failures"]),
                "-" if r["mean_lost_per_failure_s"] is None else f"{r['mean_lost_per_failure_s']:.2f}",
                str(r["steps_recomputed"]), f"{r['batches_trained']}/{r['batches_scheduled']}",
                f"{r['wasted_worker_s']:.0f}", f"{r['idle_spare_worker_s']:.0f}" if r["idle_spare_worker_s"] else "-",
                "-" if r["final_loss"] is None else f"{r['final_loss']:.4f}", eq + ("" if r["ok"] else " (FAILED)"))
    body = [COLS] + [fmt(r) for r in rows]
    widths = [max(len(row[i]) for row in body) for i in range(len(COLS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join("   " + l for l in lines)


def plot(path: str, scenarios: dict[str, dict[str, Any]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"hotspare": "tab:green", "ckpt-legacy": "tab:red", "ckpt-yd": "tab:orange", "torchft": "tab:blue",
              "ckpt": "tab:red"}
    fig, axes = plt.subplots(1, len(scenarios), figsize=(7 * len(scenarios), 4.8), squeeze=False)
    for ax, (name, sc) in zip(axes[0], scenarios.items()):
        for r in sc["rows"]:
            key = r["label"].split("-", 1)[1]
            if not r["progress"]:
                continue
            c = colors.get(key, "gray")
            # contiguous progress as solid segments; a restart (the step goes back) as a dotted
            # stall at the old step, then the drop to the step the job resumed from
            segs, cur = [], [r["progress"][0]]
            for a, b2 in zip(r["progress"], r["progress"][1:]):
                if b2[1] <= a[1]:
                    segs.append(cur)
                    cur = []
                cur.append(b2)
            segs.append(cur)
            for i, seg in enumerate(segs):
                t, s = zip(*seg)
                ax.plot(t, s, color=c, lw=1.4, label=f"{key} ({r['jct_s']:.0f} s)" if i == 0 else None)
                if i + 1 < len(segs):
                    (ta, sa), (tb, sb) = seg[-1], segs[i + 1][0]
                    ax.plot([ta, tb, tb], [sa, sa, sb], color=c, lw=1, ls=":")
            for k in r["kills"]:
                if k.get("fired"):
                    ax.plot(k["fired_s"], max(k["job_step"], 0), marker="x", color=c, ms=8, mew=2)
        ax.set_title(sc["title"], fontsize=10)
        ax.set_xlabel("wall time since launch (s)")
        ax.set_ylabel("committed step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right", title="x = SIGKILL", title_fontsize=8)
    fig.suptitle("Job progress under failures, same job and failure schedule (4 CPU ranks, gloo)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python bench/compare.py", description=__doc__.split("\n")[0],
        epilog=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="main scenario only, 40 steps, 1 failure, no replica (under 3 minutes)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {', '.join(SYSTEMS)} (default: all)")
    g = p.add_argument_group("main scenario")
    g.add_argument("--model", default="1m", choices=("tiny", "1m", "5m"), help="the example's preset (default: 1m)")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step (default: 8)")
    g.add_argument("--steps", type=int, help="steps to train (default: 300; --quick: 40)")
    g.add_argument("--failures", type=int, help="SIGKILLs spread over the job's steps (default: 3; --quick: 1)")
    g.add_argument("--kill-steps", metavar="S1,S2,...",
                   help="explicit failures instead of --failures: kill once the job first commits step S")
    g.add_argument("--kill-at", metavar="T1,T2,...",
                   help="explicit failures at wall-clock seconds from launch instead of --failures")
    g.add_argument("--kill-ranks", metavar="R1,R2,...",
                   help="ranks for --kill-steps/--kill-at (default: seeded draws)")
    g.add_argument("--seed", type=int, default=6, help="seed of the failure schedules (default: 6)")
    g.add_argument("--legacy-every", type=int, metavar="K",
                   help="checkpoint interval of ckpt-legacy in steps (default: 100, Clockwork's; --quick: 20)")
    g.add_argument("--yd-every", type=int, metavar="K",
                   help="checkpoint interval of ckpt-yd in steps (default: Young/Daly from the measured "
                        "checkpoint cost and the schedule's MTBF)")
    g.add_argument("--ckpt-pin-buckets", action="store_true",
                   help="run checkpoint-restart (and the plain-DDP reference) with DDP's buckets laid out once, "
                        "as hotspare does: a restart from a checkpoint is then bit for bit the fault-free run "
                        "(stock DDP, the default, re-buckets after the first step of every process)")
    r = p.add_argument_group("Clockwork replica")
    r.add_argument("--no-replica", action="store_true", help="skip the replica scenario")
    r.add_argument("--replica-only", action="store_true", help="run only the replica scenario")
    r.add_argument("--replica-model", default="tiny", choices=("tiny", "1m", "5m"),
                   help="preset for the replica (default: tiny, about 40 ms a step here with batch 64)")
    r.add_argument("--replica-batch-size", type=int, default=64, help="(default: 64)")
    r.add_argument("--replica-steps", type=int, default=1000,
                   help="steps of the replica (Clockwork: 3,000; default: 1,000, to fit the time budget; "
                        "the failure rate per step, not the length, sets the ratios)")
    r.add_argument("--clockwork-step-s", type=float, default=8.1,
                   help="Clockwork's step time used to express their failure gaps in steps (default: 8.1 s "
                        "= 405 min / 3,000 steps, an upper bound)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write every number (and each run's progress) here")
    o.add_argument("--plot", metavar="PNG", help="plot committed step vs wall time, failures marked")
    o.add_argument("--keep-logs", metavar="DIR", help="keep each run's log, reports and checkpoints in DIR "
                                                      "(default: a temporary folder, removed at the end)")
    args = p.parse_args(argv)

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        p.error(f"--systems: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(SYSTEMS)}")
    args.systems = [s for s in SYSTEMS if s in systems]
    if args.quick and args.replica_only:
        p.error("--quick runs the main scenario only; drop --replica-only")
    if args.no_replica and args.replica_only:
        p.error("--no-replica and --replica-only exclude each other")
    args.steps = args.steps if args.steps is not None else (40 if args.quick else 300)
    args.failures = args.failures if args.failures is not None else (1 if args.quick else 3)
    args.legacy_every = args.legacy_every if args.legacy_every is not None else (20 if args.quick else 100)
    for name in ("steps", "batch_size", "replica_steps", "replica_batch_size", "legacy_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.yd_every is not None and args.yd_every < 1:
        p.error("--yd-every must be at least 1")
    if args.failures < 0:
        p.error("--failures must be 0 or more")
    if args.clockwork_step_s <= 0:
        p.error("--clockwork-step-s must be > 0")
    args.kill_times = None
    if args.kill_steps:
        if args.kill_at:
            p.error("give --kill-steps or --kill-at, not both")
        try:
            args.kill_steps = [int(x) for x in args.kill_steps.split(",")]
        except ValueError:
            p.error(f"--kill-steps {args.kill_steps!r}: give steps, e.g. --kill-steps 40,120")
        if any(not 0 <= x < args.steps for x in args.kill_steps):
            p.error(f"--kill-steps must lie in 0-{args.steps - 1} (the job has {args.steps} steps)")
    if args.kill_at:
        try:
            args.kill_times = [float(x) for x in args.kill_at.split(",")]
        except ValueError:
            p.error(f"--kill-at {args.kill_at!r}: give seconds from launch, e.g. --kill-at 20,45.5")
        if any(t <= 0 for t in args.kill_times):
            p.error("--kill-at times must be > 0 seconds")
    if args.kill_ranks:
        points = args.kill_times or args.kill_steps
        if not points:
            p.error("--kill-ranks needs --kill-steps or --kill-at")
        try:
            args.kill_ranks = [int(x) for x in args.kill_ranks.split(",")]
        except ValueError:
            p.error(f"--kill-ranks {args.kill_ranks!r}: give ranks 0-{WORLD - 1}, e.g. --kill-ranks 2,1")
        if len(args.kill_ranks) != len(points) or any(not 0 <= r < WORLD for r in args.kill_ranks):
            p.error(f"--kill-ranks needs one rank in 0-{WORLD - 1} per failure")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib: pip install -e '.[plot]'")
    if "torchft" in args.systems:
        try:
            import torchft  # noqa: F401
        except ImportError:
            p.error("the torchft system needs torchft 0.2.0: pip install -e '.[compare]' "
                    "(or leave it out: --systems hotspare,ckpt-legacy,ckpt-yd)")
        if shutil.which("torchft_lighthouse") is None:
            p.error("torchft is installed but torchft_lighthouse is not on PATH")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    Torchrun.pin_buckets = args.ckpt_pin_buckets
    b = Bench(args)
    out: dict[str, Any] = {
        "command": "python bench/compare.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "source": _source_state(), "scenarios": {}}
    try:
        import torch
        out["machine"]["torch"] = torch.__version__
        import torchft  # noqa: F401
        from importlib.metadata import version
        out["machine"]["torchft"] = version("torchft")
    except ImportError:
        pass
    src = out["source"]
    b.say(f"4 ranks, CPU/gloo, {os.cpu_count()} cores; systems: {', '.join(args.systems)}; hotspare at "
          f"{src['commit'][:10]}{' + uncommitted changes' if src['hotspare_dirty'] else ''}; logs in {b.workdir}")
    scenarios: dict[str, dict[str, Any]] = {}
    try:
        if not args.replica_only:
            scenarios["main"] = main_scenario(b, args)
        if not (args.quick or args.no_replica):
            scenarios["replica"] = replica_scenario(b, args)
    finally:
        b.bar.close()
        if not args.keep_logs:
            shutil.rmtree(b.workdir, ignore_errors=True)

    for name, sc in scenarios.items():
        out["scenarios"][name] = sc
        print(f"\n== {sc['title']}")
        print(table(sc["rows"], sc.get("hotspare_jct_s")))
        for line in sc["notes"]:
            print(f"   {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"\nJSON written to {args.json}")
    if args.plot:
        plot(args.plot, scenarios)
        print(f"plot written to {args.plot}")
    b.say("done")
    failed = [r["label"] for sc in scenarios.values() for r in sc["rows"] if not r["ok"]]
    if failed:
        print(f"runs that did not finish: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _source_state() -> dict[str, Any]:
    """The commit measured, and whether hotspare/ had uncommitted changes (a shared checkout)."""
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"commit": git("rev-parse", "HEAD"), "hotspare_dirty": bool(git("status", "--porcelain", "hotspare"))}


def _ratios(rows: list[dict[str, Any]], key: str = "jct_s") -> tuple[float | None, dict[str, float]]:
    hs = next((r for r in rows if r["system"] == "hotspare"), None)
    if hs is None or not hs[key]:
        return None, {}
    return hs[key], {r["label"].split("-", 1)[1]: round(hs[key] / r[key], 3)
                     for r in rows if r is not hs and r[key]}


def main_scenario(b: Bench, args: argparse.Namespace) -> dict[str, Any]:
    script = ["--model", args.model, "--batch-size", str(args.batch_size), "--steps", str(args.steps)]
    b.say(f"main scenario: model {args.model}, batch {args.batch_size}/rank, {args.steps} steps")
    ref = b.references("main", script, args.steps, with_hotspare="hotspare" in args.systems)
    if args.kill_times or args.kill_steps:
        rng = random.Random(args.seed)
        points = args.kill_times or args.kill_steps
        ranks = args.kill_ranks or [rng.randrange(WORLD) for _ in points]
        if args.kill_times:
            kills = [Kill(r, at_s=t) for t, r in zip(points, ranks)]
            gaps = [b2 - a for a, b2 in zip([0.0] + points, points)]
            sched = Schedule(kills, statistics.mean(gaps), "explicit --kill-at (seconds from launch)")
        else:
            kills = [Kill(r, at_step=st) for st, r in zip(points, ranks)]
            gaps = [b2 - a for a, b2 in zip([0] + points, points)]
            sched = Schedule(kills, statistics.mean(gaps) * ref["ideal_step_s"], "explicit --kill-steps")
    elif args.failures:
        sched = spread_schedule(args.failures, args.steps, ref["ideal_step_s"], args.seed)
    else:
        sched = Schedule([], float("inf"), "no failures")
    b.say(f"   ideal (plain DDP, fault-free): {ref['plain'].jct_s:.1f} s, step {1000 * ref['ideal_step_s']:.0f} ms; "
          f"schedule: {sched.describe() or 'none'}")
    res = b.faulty("main", script, args.steps, sched, args.systems, args.legacy_every, args.yd_every, ref)
    rows = []
    for name, run in res["runs"].items():
        digest_ref = ref.get("hotspare_digest") if name == "hotspare" else ref["plain_digest"]
        rows.append(summarize(run, ref["ideal_step_s"], digest_ref, spares=1 if name == "hotspare" else 0))
    hs_jct, ratios = _ratios(rows)
    notes = [f"ideal: plain DDP under torchrun, fault-free, {ref['plain'].jct_s:.1f} s "
             f"(step {1000 * ref['ideal_step_s']:.0f} ms); failures: {sched.describe() or 'none'}",
             "checkpoint intervals: " + "; ".join(
                 x for x in (f"legacy every {res['legacy_every']} steps" if "ckpt-legacy" in args.systems else "",
                             f"Young/Daly every {res['yd_every']} steps" if "ckpt-yd" in args.systems else "",
                             f"C = {res['checkpoint_cost_s']:.3f} s, M = {sched.mtbf_s:.1f} s"
                             if "checkpoint_cost_s" in res else "") if x) or "none"]
    _, norm = _ratios(rows, "jct_at_ideal_step_s")
    if ratios:
        notes.append("headline, JCT hotspare / other: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
        notes.append("the same with every system's steady step at the ideal step time (norm JCT): "
                     + ", ".join(f"{k} {v:.2f}" for k, v in norm.items()))
    hs_ff = ref.get("hotspare")
    return {"title": f"main: {args.model} GPT, batch {args.batch_size}, {args.steps} steps, 4 ranks",
            "rows": rows, "hotspare_jct_s": hs_jct, "ratios_hotspare_over": ratios,
            "normalized_ratios_hotspare_over": norm, "notes": notes,
            "schedule": {"how": sched.how, "kills": [asdict(k) for k in sched.kills], "mtbf_s": sched.mtbf_s},
            "reference": {"plain_ddp_jct_s": round(ref["plain"].jct_s, 2), "ideal_step_s": ref["ideal_step_s"],
                          "plain_ddp_digest": ref["plain_digest"],
                          "hotspare_fault_free_jct_s": round(hs_ff.jct_s, 2) if hs_ff else None,
                          "hotspare_fault_free_digest": ref.get("hotspare_digest"),
                          "commands": ref["plain"].commands + (hs_ff.commands if hs_ff else [])},
            "checkpoint": {k: res.get(k) for k in ("legacy_every", "yd_every", "checkpoint_cost_s", "daly_interval_s")}}


def replica_scenario(b: Bench, args: argparse.Namespace) -> dict[str, Any]:
    steps = args.replica_steps
    script = ["--model", args.replica_model, "--batch-size", str(args.replica_batch_size), "--steps", str(steps)]
    b.say(f"Clockwork replica: model {args.replica_model}, batch {args.replica_batch_size}/rank, {steps} steps")
    probe_steps = 200
    probe = b.go(Torchrun("replica-step-probe", b.workdir, b.env, script[:-2] + ["--steps", str(probe_steps)],
                          every=0), probe_steps, None, expect_s=60)
    step_s = median_step(probe)
    if not probe.ok or not step_s:
        raise SystemExit(f"the replica's step-time probe failed; see {probe.log}")
    lo, hi = (g / args.clockwork_step_s * step_s for g in CLOCKWORK["gap_s"])
    ideal_jct = probe.progress[0][0] + steps * step_s
    sched = renewal_schedule(lo, hi, horizon_s=20 * ideal_jct, seed=args.seed + 1)
    b.say(f"   step {1000 * step_s:.1f} ms -> failure gaps {lo:.1f}-{hi:.1f} s "
          f"({CLOCKWORK['gap_s'][0] / args.clockwork_step_s:.0f}-{CLOCKWORK['gap_s'][1] / args.clockwork_step_s:.0f} "
          f"step times), checkpoint every {CLOCKWORK['ckpt_every']} steps")
    systems = [s for s in args.systems if s in ("hotspare", "ckpt-legacy", "torchft")]
    runs: dict[str, Run] = {}
    for name in systems:
        if name == "hotspare":
            sysm: System = Hotspare("replica-hotspare", b.workdir, b.env, script)
        elif name == "ckpt-legacy":
            sysm = Torchrun("replica-ckpt", b.workdir, b.env, script, every=CLOCKWORK["ckpt_every"])
        else:
            sysm = TorchFT("replica-torchft", b.workdir, b.env, script)
        runs[name] = b.go(sysm, steps, sched, expect_s=ideal_jct)
    rows = [summarize(run, step_s, None, spares=1 if n == "hotspare" else 0) for n, run in runs.items()]
    hs_jct, ratios = _ratios(rows)
    cw = CLOCKWORK["jct_min"]
    notes = [f"failures every {lo:.1f}-{hi:.1f} s from launch (Clockwork's 2,700-4,500 s in step times x "
             f"{1000 * step_s:.1f} ms), checkpoint every {CLOCKWORK['ckpt_every']} steps; no fault-free "
             f"digest reference in this scenario (= fault-free: n/a)",
             f"Clockwork, JCT TorchPass / other: ckpt {cw['hotspare'] / cw['ckpt']:.2f}, "
             f"torchft {cw['hotspare'] / cw['torchft']:.2f} (405 : 818 : 930 min)"]
    _, norm = _ratios(rows, "jct_at_ideal_step_s")
    if ratios:
        notes.append("here, JCT hotspare / other: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
                     + "; with steady steps at the ideal step time: "
                     + ", ".join(f"{k} {v:.2f}" for k, v in norm.items()))
        order = [("hotspare", 1.0)] + [(k, 1 / v) for k, v in ratios.items()]
        notes.append("scaled so that hotspare = 405: " + " : ".join(f"{k} {405 * x:.0f}" for k, x in order))
    return {"title": f"Clockwork replica: {args.replica_model} GPT, batch {args.replica_batch_size}, {steps} steps, "
                     f"4 ranks, failures every {lo:.1f}-{hi:.1f} s",
            "rows": rows, "hotspare_jct_s": hs_jct, "ratios_hotspare_over": ratios,
            "normalized_ratios_hotspare_over": norm, "notes": notes,
            "clockwork": CLOCKWORK, "step_s": step_s, "gap_s": [lo, hi],
            "schedule": {"how": sched.how, "kills": [asdict(k) for k in sched.kills], "mtbf_s": sched.mtbf_s}}


if __name__ == "__main__":
    sys.exit(main())
