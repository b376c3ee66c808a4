"""Each job's rendezvous store (``hotspare.pg.storeproc``), in a process of its own that the
coordinator service starts, finds again after a restart, and stops when the job is over (or
when the job is cancelled while its store starts)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

STOP_WAIT_S = 5.0
_procs: dict[int, subprocess.Popen] = {}       # the stores this process started: reaped when stopped


def start_store(host: str) -> dict[str, Any]:
    """A new store on ``host`` (the service's address): {"host", "port", "pid"}; OSError if it did not start."""
    proc = subprocess.Popen([sys.executable, "-m", "hotspare.pg.storeproc", host], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    line = proc.stdout.readline().strip()
    if not line.isdigit():
        proc.kill()
        proc.wait()
        raise OSError(f"the job's rendezvous store did not start on {host}")
    _procs[proc.pid] = proc
    return {"host": host, "port": int(line), "pid": proc.pid}


def store_alive(store: dict[str, Any]) -> dict[str, Any]:
    """After a restart: the job's store, started again on its port if its process is gone."""
    try:
        os.kill(int(store["pid"]), 0)
        return store
    except OSError:
        pass
    proc = subprocess.Popen([sys.executable, "-m", "hotspare.pg.storeproc", store["host"], str(store["port"])],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    if not proc.stdout.readline().strip().isdigit():
        raise OSError(f"the job's rendezvous store could not be started again on {store['host']}:{store['port']}")
    _procs[proc.pid] = proc
    return {**store, "pid": proc.pid}


def stop_store(store: dict[str, Any]) -> None:
    """SIGTERM to the store; one this process started is waited for (SIGKILL after ``STOP_WAIT_S``)."""
    try:
        pid = int(store["pid"])
        os.kill(pid, signal.SIGTERM)
    except (OSError, KeyError, ValueError):
        return
    proc = _procs.pop(pid, None)
    if proc is not None:
        try:
            proc.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
