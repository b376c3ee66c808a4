"""``hotspare run`` inside the test process, over one warm zygote shared by every job.

A real-process failover test pays, before its first step, for two interpreters that import
torch (the launcher's and its agent's zygote, ~5 s of CPU) and then for the job itself. Here
the launcher runs in the calling process (``hotspare.cli.run.run``, the very code of
``hotspare run``: the real ``Coordinator``, ``policy.decide``, the node agent, the health desk,
the rendezvous store) and its agents fork workers from a zygote started once (``Launcher``):
a job costs what its workers do. The workers are real processes on a real gloo group, killed
by real signals when a fault says so, and the report is the one ``hotspare run --report``
writes: ``run`` returns the same ``JobResult`` as ``hotspare.testing.local.run_job``, whose
tests move here unchanged.

What it cannot stand in for: the launcher's own process (its signals, its exit code as a
shell sees it, its interpreter start), so the tests of those keep ``run_job``.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from hotspare.testing.local import EXAMPLE, JobResult


class Launcher:
    """A warm zygote, and ``run`` for each job. ``close()`` ends the zygote."""

    def __init__(self) -> None:
        from hotspare.agent.zygote import TORCH_PRELOAD, Zygote
        read, write = os.pipe()
        # the workers' common environment (hotspare run gives each its own on top); this process's
        # own environment is left as it is
        env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}
        self._zygote = Zygote(env, preload=TORCH_PRELOAD, output=write)
        os.close(write)
        self._output = io.StringIO()
        self._lock = threading.Lock()
        self._drain = threading.Thread(target=self._read, args=(read,), name="inproc-output", daemon=True)
        self._drain.start()
        self._run_lock = threading.Lock()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "r", encoding="utf-8", errors="replace") as f:
            for line in f:
                with self._lock:
                    self._output.write(line)

    def _take_output(self, settle_s: float = 0.0) -> str:
        """What the workers wrote since the last take; ``settle_s``: first wait until they have
        written nothing for that long (their last lines may still be in the pipe)."""
        last = None
        for _ in range(int(3.0 / max(settle_s, 0.01)) if settle_s else 0):
            with self._lock:
                size = self._output.tell()
            if size == last:
                break
            last = size
            time.sleep(settle_s)
        with self._lock:
            text, self._output = self._output.getvalue(), io.StringIO()
        return text

    def run(self, script_args: list[str], nproc: int = 4, spares: int = 1, inject: list[str] = (),
            script: str | Path = EXAMPLE, extra: list[str] = (), timeout: float = 300,
            env: dict[str, str] | None = None) -> JobResult:
        """Run one job to its end, as ``run_job`` does (``timeout``: the job is stopped after
        it, like ``hotspare run`` on SIGTERM, and the result says so)."""
        from hotspare.cli.main import build_parser
        from hotspare.cli.run import run as launch
        with self._run_lock, tempfile.TemporaryDirectory() as tmp:
            report = os.path.join(tmp, "report.json")
            argv = ["run", "--nproc", str(nproc), "--spares", str(spares), "--report", report, *extra]
            for spec in inject:
                argv += ["--inject", spec]
            argv += ["--", str(script), *script_args]
            args = build_parser().parse_args(argv)
            saved_env = dict(os.environ)
            saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)}
            os.environ.update(env or {})
            self._take_output()
            out = io.StringIO()
            timer = threading.Timer(timeout, os.kill, (os.getpid(), signal.SIGTERM))
            timer.daemon = True
            code = 1
            try:
                timer.start()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                    code = launch(args, zygote=self._zygote)
            finally:
                timer.cancel()
                for sig, handler in saved.items():
                    signal.signal(sig, handler)
                os.environ.clear()
                os.environ.update(saved_env)
                sys.stdout.flush()
            workers = self._take_output(settle_s=0.1)
            data = json.load(open(report)) if os.path.exists(report) else None
            return JobResult(code, out.getvalue() + workers, data)

    def close(self) -> None:
        self._zygote.close()


_launcher: Launcher | None = None


def run_inproc(script_args: list[str], nproc: int = 4, spares: int = 1, inject: list[str] = (),
               script: str | Path = EXAMPLE, extra: list[str] = (), timeout: float = 300,
               env: dict[str, str] | None = None) -> JobResult:
    """``run_job``'s twin, in this process: the first call starts the shared zygote (ended at
    exit). Same arguments, same result."""
    global _launcher
    if _launcher is None:
        _launcher = Launcher()
        import atexit
        atexit.register(_launcher.close)
    return _launcher.run(script_args, nproc=nproc, spares=spares, inject=inject, script=script, extra=extra,
                         timeout=timeout, env=env)


_fault_free: dict[tuple, JobResult] = {}


def fault_free(script_args: list[str], nproc: int = 4, script: str | Path = EXAMPLE,
               extra: list[str] = ()) -> JobResult:
    """The fault-free run of a job, once per test session (the reference several test modules
    compare their faulted runs with): a successful run is kept, keyed by its arguments."""
    key = (tuple(script_args), nproc, str(script), tuple(extra))
    if key not in _fault_free:
        result = run_inproc(script_args, nproc=nproc, spares=1, script=script, extra=extra)
        if result.code != 0 or not result.report or result.report["failures_total"] != 0:
            return result               # not kept: the caller's assertion shows why
        _fault_free[key] = result
    return _fault_free[key]
