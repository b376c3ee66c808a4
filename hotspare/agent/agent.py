"""The node agent: spawns and supervises worker and spare processes on one host.

It owns the processes (so it sees an exit the moment it happens; they fork from its zygote,
``hotspare.agent.zygote``, or start as fresh interpreters) and the control connections of
its workers (JSON lines over TCP, see ``hotspare.protocol``). It talks to the coordinator over
one more such connection, which it opens itself (or, in the launcher's own process, an
in-process link, ``hotspare.protocol.local``): what it sees (a worker started, exited, said
something) goes up as a message; the coordinator's decisions come down as commands (``spawn``,
``kill``, ``deliver``, ``shutdown``; ``admit`` and ``diagnose`` run device checks here, see
``hotspare.agent.checks``). A command the agent cannot carry out is answered with
``refused``; the job goes on. Fault injection is a plug-in (``hotspare.testing.faults.AgentFaults``,
given as ``faults``), which adds its commands (``arm``, ``disarm``) and sees each worker message
before it is relayed; without it none of its code runs.
In ``hotspare run`` the agent lives in the launcher beside the coordinator, linked in-process;
the rest is the code path a remote agent takes.

Both of its network connections are authenticated (``hotspare.protocol.auth``): it proves the job secret
to the coordinator, and each worker it spawns gets its own token in its environment and must
prove it on the worker port; a worker id that already has a connection cannot get a second one,
and only a worker's own kinds of message are relayed.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from hotspare.agent.checks import NodeChecks
from hotspare.agent.zygote import (ForkedProc, Zygote, ZygoteError, die_with_parent, forkable,
                                   preload_for)
from hotspare.errors import ConfigError, ProtocolError
from hotspare.protocol import auth
from hotspare.protocol.channel import Channel
from hotspare.protocol.listen import Listener, bound_server
from hotspare.protocol.messages import FROM_WORKER, Message, make, validate
from hotspare.protocol.workerenv import JobEnv, WorkerEnv, without_contract

SPAWN_METHODS = ("fork", "exec")
REGISTER_S = 10.0         # a worker's hello waits at most this long for its spawn to be recorded
DRAIN_S = 0.5             # at most this long, a worker's last messages go up before its exit


@dataclass
class WorkerProc:
    worker: str
    role: str
    proc: subprocess.Popen | ForkedProc
    device: str | None = None
    channel: Channel | None = None
    exit_code: int | None = None
    stopped: bool = False
    drained: threading.Event = field(default_factory=threading.Event)   # its channel reached EOF
    reaped: threading.Event = field(default_factory=threading.Event)    # the process is gone


class NodeAgent:
    def __init__(self, cmd: list[str], base_env: dict[str, str], coordinator: str, secret: bytes,
                 node: str | None = None, host: str = "127.0.0.1", devices: list[str] | None = None,
                 spawn: str = "fork", faults=None, uplink: Channel | None = None, zygote: Zygote | None = None):
        """Start serving workers on ``host`` and connect to the coordinator at ``coordinator``
        (host:port), proving ``secret`` (the job's). ``devices``: the node's device slots
        ("host/cpu0"...); the coordinator places each worker on one. ``spawn``: "fork" forks
        workers from a zygote that has imported torch (``hotspare.agent.zygote``) where ``cmd``
        allows, "exec" starts each as a fresh interpreter. ``faults``: the fault-injection
        plug-in (``hotspare.testing.faults.AgentFaults``), for tests and drills; None in production.
        ``uplink``: a link to the coordinator already authenticated (a remote agent's,
        ``hotspare.agent.remote``) or in-process (the launcher's own agents,
        ``hotspare.protocol.local``) instead of connecting here. ``zygote``: a running zygote to fork
        from, kept open when the agent closes (the in-process test harness shares one across
        jobs: ``hotspare.testing.inproc``)."""
        if spawn not in SPAWN_METHODS:
            raise ConfigError(f"spawn method {spawn!r} unknown; use one of {', '.join(SPAWN_METHODS)}")
        self.cmd = cmd
        # The job-wide part of the worker contract arrives as its variables in base_env (the
        # launcher wrote them, hotspare.protocol.workerenv); read once, so a bad one fails here.
        # With the fault plug-in, the workers load theirs (hotspare.testing.faults.worker).
        self.faults = faults
        job_env = JobEnv.from_env(base_env)
        self.job_env = job_env if faults is None else dataclasses.replace(job_env, faults=True)
        self.base_env = without_contract(base_env)
        zygote_env = dict(base_env)
        if self.job_env.backend == "nccl":
            # hotspare's NCCL environment (hotspare.pg.nccl), in every worker's environment before
            # torch starts there (torch reads some of it once per process), and in the zygote's.
            from hotspare.pg.nccl import apply_nccl_environment   # imports torch: NCCL jobs only
            for line in apply_nccl_environment(self.base_env, self.job_env.join_timeout_s):
                print(f"hotspare agent: {line}", file=sys.stderr, flush=True)
            apply_nccl_environment(zygote_env, self.job_env.join_timeout_s)
        self.zygote: Zygote | None = zygote
        self._own_zygote = zygote is None
        self.node = node or socket.gethostname()
        self.devices = list(devices or [])
        self.channel_lock = threading.Lock()     # binding a worker's channel (and what a plug-in tells it then)
        self._commands_of: dict[str, Callable[[dict[str, Any]], None]] = {
            "spawn": lambda m: self.spawn(m["worker"], m["role"], m["rank"], m["device"]),
            "kill": lambda m: self.kill(m["worker"], signal.Signals(m["signal"]), m["group"]),
            "deliver": lambda m: self.send(m["worker"], validate(m["msg"])),
            "shutdown": lambda m: self.shutdown(grace=float(m["grace"])),
        }
        # admission and quarantine diagnostics of this node's devices (hotspare.agent.checks)
        self.checks = NodeChecks(self.devices, self._up)
        self._commands_of.update(self.checks.commands())
        if faults is not None:
            faults.attach(self)
            self._commands_of.update(faults.commands())
        self.host = host
        self.workers: dict[str, WorkerProc] = {}
        self._lock = threading.Lock()
        self._registered = threading.Condition(self._lock)   # a worker is in self.workers
        self._closed = threading.Event()
        self._secret = secret
        server = bound_server(host)
        self.port = server.getsockname()[1]
        self._listener = Listener(server, self._handshake, self._serve, "agent-accept")
        self.uplink = uplink or auth.connect(coordinator, auth.NODE, auth.node_key(secret), node=self.node,
                                             pid=os.getpid(), devices=self.devices,
                                             device_faults=faults is not None and faults.device_faults)
        if zygote is None and spawn == "fork" and forkable(cmd):   # it imports in the background until the first spawn
            try:
                self.zygote = Zygote(zygote_env, preload=preload_for(cmd[1]))
            except ZygoteError as e:
                print(f"hotspare agent: {e}; starting each worker as a fresh interpreter", file=sys.stderr,
                      flush=True)
        threading.Thread(target=self._commands, name="agent-commands", daemon=True).start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def report(self, type_: str, **fields: Any) -> None:
        """Tell the coordinator (for plug-ins: e.g. a fault that fired)."""
        self._up(type_, **fields)

    def _up(self, type_: str, **fields: Any) -> None:
        """Tell the coordinator; if the link is gone, ``_commands`` is already ending the node."""
        try:
            self.uplink.send(make(type_, **fields))
        except OSError:
            pass

    # ------------------------------------------------------------------ commands
    def _commands(self) -> None:
        while True:
            try:
                msg = self.uplink.recv()
            except ProtocolError as e:           # one bad line: refused, the link goes on
                self._up("refused", command="?", message=str(e))
                continue
            except OSError:
                msg = None
            if msg is None:
                break
            try:
                self._command(msg)
            except Exception as e:               # a command that cannot be carried out harms nothing else
                why = str(e) if isinstance(e, (ProtocolError, ConfigError)) else f"{type(e).__name__}: {e}"
                self._up("refused", command=msg["type"], message=why)
            if msg["type"] == "shutdown":
                return
        # The coordinator is gone: nothing can coordinate these workers any more.
        if not self._closed.is_set():
            print("hotspare agent: lost the coordinator; ending this node's workers", file=sys.stderr,
                  flush=True)
            self.shutdown(grace=0.0)

    def _command(self, msg: dict[str, Any]) -> None:
        run = self._commands_of.get(msg["type"])
        if run is None:
            raise ProtocolError(f"{msg['type']!r} is not a command for a node agent")
        run(msg)

    # ------------------------------------------------------------------ processes
    def spawn(self, worker: str, role: str, rank: int | None, device: str | None) -> None:
        if worker in self.workers:
            raise ProtocolError(f"worker {worker} already exists on node {self.node}")
        if device is not None and device not in self.devices:
            raise ProtocolError(f"device {device!r} is not one of node {self.node}'s: {self.devices}")
        contract = WorkerEnv.of(self.job_env, agent=self.address, worker=worker, role=role, device=device or None)
        env = {**self.base_env, **contract.to_env()}
        env[auth.ENV_WORKER_TOKEN] = auth.worker_token(self._secret, worker)
        env[auth.ENV_PEER_KEY] = auth.peer_key(self._secret)
        # LOCAL_RANK names the worker's device slot, as torchrun's does (cuda:LOCAL_RANK).
        local = str(self.devices.index(device)) if device else (str(rank) if rank is not None else "-1")
        if rank is not None:
            env.update(RANK=str(rank), LOCAL_RANK=local, ROLE_RANK=str(rank))
        else:
            env.update(RANK="-1", LOCAL_RANK=local)
        # Each worker leads its own process group so a fence can kill its children too, and
        # dies with the agent (PR_SET_PDEATHSIG) so no orphan outlives its job.
        try:
            proc = self._start(env)
        except OSError as e:
            self._up("refused", command="spawn", message=f"cannot start {self.cmd[:2]}: {e}")
            self._up("exited", worker=worker, code=127)
            return
        wp = WorkerProc(worker, role, proc, device=device)
        with self._lock:        # "started" goes up before anything the worker says (see _serve)
            self.workers[worker] = wp
            self._up("started", worker=worker, pid=proc.pid)
            self._registered.notify_all()
        threading.Thread(target=self._wait, args=(wp,), name=f"wait-{worker}", daemon=True).start()

    def _start(self, env: dict[str, str]) -> subprocess.Popen | ForkedProc:
        if self.zygote is not None:
            try:
                return self.zygote.spawn(self.cmd, env)
            except ZygoteError as e:         # the job goes on with fresh interpreters
                print(f"hotspare agent: {e}; starting workers as fresh interpreters from now on",
                      file=sys.stderr, flush=True)
                if self._own_zygote:
                    self.zygote.close()
                self.zygote = None
        # A Python script runs as a forked one would (agent/runscript.py): atexit, then os._exit.
        cmd = ([self.cmd[0], "-m", "hotspare.agent.runscript", *self.cmd[1:]] if forkable(self.cmd)
               else self.cmd)
        return subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_parent)

    def _wait(self, wp: WorkerProc) -> None:
        """Follow the worker as the kernel reports it, with no polling: a stop and a continue
        (SIGSTOP/SIGCONT: the hang detector names a stopped rank) and its exit."""
        while True:
            try:
                _, status = os.waitpid(wp.proc.pid, os.WUNTRACED | os.WCONTINUED)
            except ChildProcessError:           # reaped by someone else: Popen knows the code
                code = wp.proc.returncode if wp.proc.returncode is not None else -signal.SIGKILL
                break
            except InterruptedError:
                continue
            if os.WIFSTOPPED(status) or os.WIFCONTINUED(status):
                stopped = os.WIFSTOPPED(status)
                if stopped != wp.stopped:
                    wp.stopped = stopped
                    self._up("stopped", worker=wp.worker, stopped=stopped)
                continue
            code = os.waitstatus_to_exitcode(status)
            break
        wp.proc.returncode = code       # Popen's own record: its pid is not ours to signal any more
        wp.reaped.set()
        # What the worker said before it died (a crash report, its last commit) goes up first:
        # its channel ends at its death, unless a forked child still holds the socket.
        if wp.channel is not None:
            wp.drained.wait(DRAIN_S)
        wp.exit_code = code
        self._up("exited", worker=wp.worker, code=code)

    def kill(self, worker: str, sig: signal.Signals = signal.SIGKILL, group: bool = True) -> None:
        wp = self.workers.get(worker)
        if wp is None:
            raise ProtocolError(f"no worker {worker} on node {self.node}")
        try:
            if group:      # its pid names the group while any member lives, so it is not reused
                os.killpg(wp.proc.pid, sig)
            elif wp.proc.returncode is None:      # reaped: the pid may belong to someone else now
                os.kill(wp.proc.pid, sig)
        except ProcessLookupError:
            pass

    def alive(self) -> list[str]:
        with self._lock:
            return [w for w, wp in self.workers.items() if wp.exit_code is None]

    def shutdown(self, grace: float = 5.0) -> None:
        """Wait up to ``grace`` seconds for workers to exit, SIGKILL the rest, close the link."""
        deadline = time.time() + grace
        for w in self.alive():
            wp = self.workers[w]
            if not wp.reaped.wait(max(0.0, deadline - time.time())):
                self.kill(w)
                wp.reaped.wait()
        self.close()

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Block until the agent has closed (shut down, or its coordinator gone)."""
        return self._closed.wait(timeout)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.checks.close()         # before the link goes: a cut-short check still says so
        self._listener.close()
        self.uplink.close()
        if self.zygote is not None and self._own_zygote:
            self.zygote.close()

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

    def _handshake(self, ch: Channel) -> Message:
        return auth.accept(ch, auth.WORKER, lambda worker: auth.worker_token(self._secret, worker))

    def _claim(self, ch: Channel, hello: Message) -> WorkerProc:
        """Bind ``ch`` to the authenticated worker of ``hello``, which must be one of this agent's
        and have no control connection yet."""
        worker = hello["worker"]
        with self._lock:        # a forked worker can say hello before its spawn returned here
            self._registered.wait_for(lambda: worker in self.workers, timeout=REGISTER_S)
        wp = self.workers.get(worker)
        if wp is None:
            raise ProtocolError(f"worker {worker[:64]!r} is not one of node {self.node}'s")
        with self.channel_lock:
            if wp.channel is not None:
                raise ProtocolError(f"worker {worker} already has a control connection")
            wp.channel = ch
            if self.faults is not None:
                self.faults.connected(worker, ch)
        return wp

    def _serve(self, ch: Channel, hello: Message) -> None:
        wp = None
        try:
            wp = self._claim(ch, hello)
            while True:
                msg = ch.recv()
                if msg is None:
                    return
                if msg["type"] not in FROM_WORKER:
                    raise ProtocolError(f"{msg['type']!r} is not a message a worker sends")
                now = time.time()
                if self.faults is not None:      # the plug-in's triggers fire before the relay
                    self.faults.on_message(wp.worker, msg, ch, now)
                self._up("relay", worker=wp.worker, t=now, msg=msg)
        except ConnectionResetError:
            return                       # the worker died; its exit is reported by _wait
        except (OSError, ProtocolError) as e:
            # A bad message drops that connection only; the job goes on.
            print(f"hotspare agent: dropping control connection of {wp.worker if wp else hello['worker'][:64]!r} "
                  f"({auth.peer(ch)}): {e}", file=sys.stderr, flush=True)
            ch.close()
        finally:
            if wp is not None and wp.channel is ch:
                wp.drained.set()
