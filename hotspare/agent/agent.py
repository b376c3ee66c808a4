"""The node agent: spawns and supervises worker and spare processes on one host.

It owns the processes (so it sees an exit the moment it happens), the control connections of
its workers (JSON lines over TCP, see ``hotspare.protocol``), and fault injection (real signals).
Everything it observes becomes an event on the coordinator's queue; the coordinator answers by
calling ``spawn``, ``send`` and ``kill``. In ``hotspare run`` both live in the launcher process;
the interface is the same messages a remote agent would carry.
"""
from __future__ import annotations

import itertools
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from hotspare.agent.inject import Fault, Injector
from hotspare.errors import ProtocolError
from hotspare.protocol.channel import Channel, serve
from hotspare.protocol.messages import make

Event = tuple[str, str, Any, float]       # (kind, worker, payload, time)


@dataclass
class WorkerProc:
    worker: str
    role: str
    proc: subprocess.Popen
    started: float
    channel: Channel | None = None
    rank: int | None = None
    last_step: int | None = None
    exit_code: int | None = None
    injected: list[tuple[Fault, float]] = field(default_factory=list)
    device: str | None = None


def _die_with_parent() -> None:
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: workers then end when their control connection closes
        pass


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class NodeAgent:
    def __init__(self, cmd: list[str], base_env: dict[str, str], events: "queue.Queue[Event]",
                 injector: Injector | None = None, host: str = "127.0.0.1", log_dir: str | None = None,
                 devices: list[str] | None = None, usable: Callable[[str], bool] = lambda d: True,
                 device_fault: Callable[[str, Fault], None] | None = None):
        """``devices``: the node's device slots ("host/cpu0"...); each worker holds one, and a
        new worker only goes to a free one that ``usable`` accepts (not cordoned).
        ``device_fault(device, fault)`` carries out injected device faults (telemetry)."""
        self.cmd = cmd
        self.devices = list(devices or [])
        self.usable = usable
        self.device_fault = device_fault
        self.base_env = base_env
        self.events = events
        self.injector = injector or Injector([])
        self._watching = self.injector.pending()
        self._watch_lock = threading.Lock()     # decide and tell under one lock: threads race here
        self.host = host
        self.log_dir = log_dir
        self.workers: dict[str, WorkerProc] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._server = socket.create_server((host, 0))
        self.port = self._server.getsockname()[1]
        serve(self._server, self._serve, "agent-accept")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # ------------------------------------------------------------------ processes
    def free_devices(self) -> list[str]:
        """Device slots no live worker holds and ``usable`` accepts, in order."""
        with self._lock:
            held = {wp.device for wp in self.workers.values() if wp.exit_code is None}
        return [d for d in self.devices if d not in held and self.usable(d)]

    def spawn(self, role: str, rank: int | None = None, world_size: int | None = None) -> str | None:
        """Start a worker; returns its id, or None when no usable device slot is free."""
        device = None
        if self.devices:
            free = self.free_devices()
            if not free:
                return None
            device = free[0]
        worker = f"w{next(self._ids)}"
        env = dict(self.base_env)
        env.update(HOTSPARE_AGENT=self.address, HOTSPARE_WORKER_ID=worker, HOTSPARE_ROLE=role)
        # LOCAL_RANK names the worker's device slot, as torchrun's does (cuda:LOCAL_RANK).
        local = str(self.devices.index(device)) if device else (str(rank) if rank is not None else "-1")
        if device:
            env["HOTSPARE_DEVICE"] = device
        if rank is not None:
            env.update(RANK=str(rank), LOCAL_RANK=local, GROUP_RANK="0", ROLE_RANK=str(rank))
        else:
            env.update(RANK="-1", LOCAL_RANK=local)
        # Each worker leads its own process group so a fence can kill its children too, and
        # dies with the launcher (PR_SET_PDEATHSIG) so no orphan outlives its job.
        proc = subprocess.Popen(self.cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        wp = WorkerProc(worker, role, proc, time.time(), rank=rank, device=device)
        with self._lock:
            self.workers[worker] = wp
        threading.Thread(target=self._wait, args=(wp,), name=f"wait-{worker}", daemon=True).start()
        return worker

    def _wait(self, wp: WorkerProc) -> None:
        code = wp.proc.wait()
        wp.exit_code = code
        self.events.put(("exit", wp.worker, code, time.time()))

    def kill(self, worker: str, sig: signal.Signals = signal.SIGKILL, group: bool = True) -> float:
        wp = self.workers[worker]
        t = time.time()
        try:
            if group:
                os.killpg(wp.proc.pid, sig)
            else:
                os.kill(wp.proc.pid, sig)
        except ProcessLookupError:
            pass
        return t

    def alive(self) -> list[str]:
        with self._lock:
            return [w for w, wp in self.workers.items() if wp.exit_code is None]

    def shutdown(self, grace: float = 5.0) -> None:
        """Wait up to ``grace`` seconds for workers to exit, then SIGKILL the rest."""
        deadline = time.time() + grace
        for w in self.alive():
            wp = self.workers[w]
            try:
                wp.proc.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.kill(w)
                wp.proc.wait()
        self._server.close()

    # ------------------------------------------------------------------ control channels
    def send(self, worker: str, msg: dict[str, Any]) -> bool:
        wp = self.workers.get(worker)
        if wp is None or wp.channel is None:
            return False
        try:
            wp.channel.send(msg)
            return True
        except OSError:
            return False

    def watch_steps(self) -> None:
        """Workers report each step's start only while a fault waits to fire (a step boundary is
        its trigger); otherwise the per-step message is skipped: each one wakes the launcher (an
        A/B of this message alone measured ~2% of a 100 ms step on a 2-core machine; the
        comparison with torchrun did not move beyond its noise). Called when faults are armed
        or fire."""
        with self._watch_lock:
            on = self.injector.pending()
            if on != self._watching:
                self._watching = on
                for w in list(self.workers):
                    self.send(w, make("watch", steps=on))

    def _inject(self, wp: WorkerProc, fault: Fault, now: float) -> None:
        if fault.target == "device":
            if self.device_fault is None or wp.device is None:
                print(f"hotspare agent: cannot inject {fault}: no simulated telemetry for this worker's "
                      "device", file=sys.stderr, flush=True)
                return
            self.device_fault(wp.device, fault)
        elif fault.target == "worker":
            self.send(wp.worker, make("fault", kind=fault.kind, params=dict(fault.params)))
        elif fault.kind == "exit":
            # The worker's control thread calls os._exit(code): an abrupt exit with that status.
            self.send(wp.worker, make("exit_now", code=fault.code))
        else:
            self.kill(wp.worker, fault.signal, group=False)
        wp.injected.append((fault, now))
        self.events.put(("injected", wp.worker, fault, now))

    def proc_state(self, worker: str) -> str | None:
        """The kernel's one-letter state of the worker's process (R, S, D, T, Z...), or None."""
        wp = self.workers.get(worker)
        if wp is None or wp.exit_code is not None:
            return None
        try:
            with open(f"/proc/{wp.proc.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return None

    def _serve(self, ch: Channel) -> None:
        wp = None
        try:
            hello = ch.recv()
            if hello is None or hello["type"] != "hello" or hello["worker"] not in self.workers:
                raise ProtocolError(f"expected a hello from a worker of this agent, got {hello}")
            wp = self.workers[hello["worker"]]
            with self._watch_lock:
                wp.channel = ch
                if self._watching:       # before its generation arrives: in order on this channel
                    ch.send(make("watch", steps=True))
            while True:
                msg = ch.recv()
                if msg is None:
                    return
                now = time.time()
                kind = msg["type"]
                fault = None
                if kind == "step":
                    wp.rank, wp.last_step = msg["rank"], msg["step"]
                    fault = self.injector.at_step(msg["rank"], msg["step"])
                elif kind == "commit":       # the next step begins right after a commit
                    wp.rank, wp.last_step = msg["rank"], msg["step"] + 1
                elif kind == "joined" and isinstance(msg.get("committed"), int):
                    wp.last_step = msg["committed"] + 1      # the step it runs first
                elif kind in ("joining", "transfer"):
                    phase = "join" if kind == "joining" else "transfer"
                    fault = self.injector.at_phase(msg["rank"], phase, msg["gen"])
                if fault is not None:
                    self._inject(wp, fault, now)
                    self.watch_steps()
                self.events.put(("msg", wp.worker, msg, now))
        except ConnectionResetError:
            return                       # the worker died; its exit is reported by _wait
        except (OSError, ProtocolError) as e:
            # A bad message drops that connection only; the job goes on.
            print(f"hotspare agent: dropping control connection of {wp.worker if wp else '?'}: {e}",
                  file=sys.stderr, flush=True)
            ch.close()
