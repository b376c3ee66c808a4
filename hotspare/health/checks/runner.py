"""Start one check worker process per device, relay its progress, collect what it reports."""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hotspare.health.checks.result import CheckResult
from hotspare.health.checks.worker import MARK

PEER_DEATH_GRACE_S = 10.0     # after a worker dies, how long its peers may still finish


def say_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclasses.dataclass
class Outcome:
    device: str
    results: list[CheckResult] = dataclasses.field(default_factory=list)
    facts: dict | None = None
    done: bool = False
    returncode: int | None = None
    stderr_tail: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=8))
    why_unfinished: str = ""


def _env(kind: str, world: int) -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])      # the directory holding the hotspare package
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    threads = "1" if kind == "cpu" else str(max(1, (os.cpu_count() or 1) // world))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = threads                                 # numpy's float64 reference uses these
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")      # CUDA index == NVML index == gpu<i>
    return env


def run_workers(devices: list[tuple[str, str, int]], *, stage: str, sizes: dict, timeout_s: float,
                inject: dict[str, set[str]] | None = None, progress: Callable[[str], None] = say_to_stderr,
                seed: int = 0, stop: threading.Event | None = None) -> list[Outcome]:
    """Run one worker per ``(device_name, kind, index)``, all in one device group; wait for all.

    A worker that has not finished after ``timeout_s`` is killed, and so are its peers
    ``PEER_DEATH_GRACE_S`` after one of them died, and all of them once ``stop`` is set (the
    node agent is closing); what each reported up to then is kept.
    """
    inject = inject or {}
    world = len(devices)
    kinds = {k for _d, k, _i in devices}
    assert len(kinds) == 1, "one device kind per run"
    env = _env(kinds.pop(), world)
    tmp = tempfile.TemporaryDirectory(prefix="hotspare-check-")
    store = os.path.join(tmp.name, "store")
    msgs: queue.Queue = queue.Queue()
    procs, outcomes, readers = [], [], []
    short = {d: d.rsplit("/", 1)[-1] for d, _k, _i in devices}

    def read_stdout(rank, stream):
        for line in stream:
            if line.startswith(MARK):
                try:
                    msgs.put((rank, json.loads(line[len(MARK):])))
                except json.JSONDecodeError:
                    pass
        msgs.put((rank, None))

    def read_stderr(rank, stream):
        for line in stream:
            if line.strip():
                outcomes[rank].stderr_tail.append(line.rstrip())

    for rank, (dev, kind, index) in enumerate(devices):
        cfg = {"device": dev, "kind": kind, "index": index, "rank": rank, "world": world, "stage": stage,
               "sizes": sizes, "inject": sorted(inject.get(dev, ())), "store": store,
               "timeout_s": timeout_s, "seed": seed}
        p = subprocess.Popen([sys.executable, "-m", "hotspare.health.checks.worker", json.dumps(cfg)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        procs.append(p)
        outcomes.append(Outcome(dev))
        for fn, stream in ((read_stdout, p.stdout), (read_stderr, p.stderr)):
            t = threading.Thread(target=fn, args=(rank, stream), daemon=True)
            t.start()
            readers.append(t)

    deadline = time.monotonic() + timeout_s
    open_streams = world
    kill_at = None
    killed = False
    try:
        while open_streams:
            try:
                rank, msg = msgs.get(timeout=0.1)
            except queue.Empty:
                rank, msg = None, None
            else:
                o = outcomes[rank]
                if msg is None:
                    open_streams -= 1
                elif msg["type"] == "facts":
                    o.facts = msg["facts"]
                elif msg["type"] == "result":
                    r = CheckResult.from_dict(msg["result"])
                    o.results.append(r)
                    progress(f"[{short[o.device]}] {r.line()}")
                elif msg["type"] == "done":
                    o.done = True
            now = time.monotonic()
            for i, p in enumerate(procs):
                if p.poll() is not None and not outcomes[i].done and kill_at is None and not killed and world > 1:
                    kill_at = now + PEER_DEATH_GRACE_S
            cancelled = stop is not None and stop.is_set()
            if not killed and (cancelled or now >= deadline or (kill_at is not None and now >= kill_at)):
                why = ("cancelled" if cancelled else f"timed out after {timeout_s:g} s" if now >= deadline
                       else "a peer died and the device group could not finish")
                for i, p in enumerate(procs):
                    if p.poll() is None:
                        p.kill()
                        outcomes[i].why_unfinished = why
                killed = True
                hard_stop = now + 30.0
            if killed and now >= hard_stop:        # a pipe some grandchild still holds open
                break
    finally:
        for i, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
            outcomes[i].returncode = p.wait()
        for t in readers:
            t.join(timeout=5)
        tmp.cleanup()
    for o in outcomes:
        if not o.done and not o.why_unfinished:
            tail = f": {o.stderr_tail[-1]}" if o.stderr_tail else ""
            o.why_unfinished = f"worker exited with status {o.returncode} before finishing{tail}"
    return outcomes


def fill_missing(device: str, results: list[CheckResult], why: str, expected: list[str]) -> list[CheckResult]:
    """``results`` plus a failed result for each expected check that is not among them."""
    have = {r.name for r in results}
    missing = [CheckResult(name, device, False, f"did not run to the end: {why or 'unknown reason'}")
               for name in expected if name not in have]
    return results + missing
