"""A job across network namespaces (``hotspare.testing.netns``): the launcher in the hub, one
``hotspare agent`` per host, their output followed line by line so a test can wait for what
the log says (a step, a node declared lost) instead of sleeping.

Agents are started one at a time, each once the launcher has logged the previous one's
connection, so placement is fixed: the first host holds ranks 0 and 1, the second ranks 2 and
3, the third the spares (``Nodes`` places on the first node with a free slot).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from hotspare.testing.local import EXAMPLE, REPO
from hotspare.testing.netns import Hosts

PORT = 29400


class Output:
    """A process's output lines, as they come, each with the time it was read."""

    def __init__(self, proc: subprocess.Popen, echo: str | None = None):
        self.proc = proc
        self.lines: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._echo = echo
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append((time.time(), line.rstrip("\n")))
                self._cond.notify_all()
            if self._echo is not None:
                print(f"{self._echo}| {line}", end="", flush=True)
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> tuple[float, re.Match]:
        """The first line matching ``pattern`` (its read time and match); AssertionError after
        ``timeout`` seconds or when the process ended without one."""
        rx = re.compile(pattern)
        deadline = time.time() + timeout
        with self._cond:
            seen = 0
            while True:
                for t, line in self.lines[seen:]:
                    m = rx.search(line)
                    if m:
                        return t, m
                seen = len(self.lines)
                left = deadline - time.time()
                if left <= 0 or (self.proc.poll() is not None and seen == len(self.lines)):
                    raise AssertionError(f"no line matching {pattern!r} within {timeout:.0f} s:\n{self.text()}")
                self._cond.wait(min(left, 0.5))

    def text(self) -> str:
        with self._cond:
            return "\n".join(line for _, line in self.lines)


class HostJob:
    def __init__(self, net: Hosts, secret_file: str, report: str, script_args: list[str], nproc: int = 4,
                 spares: int = 2, devices: int = 2, extra: list[str] = (), env: dict[str, str] | None = None,
                 echo: bool = False, agent_extra: list[str] = ()):
        """``extra``: more launcher flags; ``agent_extra``: more flags for every agent (``--allow-inject``)."""
        self.net, self.secret_file, self.report_path = net, secret_file, report
        self.env = {"PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO)), "OMP_NUM_THREADS": "1", **(env or {})}
        self.address = f"{net.hub_addr}:{PORT}"
        self.echo, self.agent_extra = echo, list(agent_extra)
        cmd = [sys.executable, "-m", "hotspare", "run", "--listen", self.address,
               "--remote-nodes", str(len(net.hosts)), "--secret-file", secret_file, "--nproc", str(nproc),
               "--spares", str(spares), "--report", report, *extra, "--", str(EXAMPLE), *script_args]
        self.launcher = self._popen(net.hub, cmd, "launcher")
        self.log = Output(self.launcher, "launcher" if echo else None)
        self.log.wait_for(r"nodes: waiting for", 60)
        self.agents: dict[str, subprocess.Popen] = {}
        self.agent_logs: dict[str, Output] = {}
        for name in net.hosts:
            self.start_agent(name, name, devices)
            self.log.wait_for(rf"NODE    {name}: agent pid \d+ connected", 60)

    def _popen(self, ns: str, cmd: list[str], what: str) -> subprocess.Popen:
        return subprocess.Popen(self.net.argv(ns, cmd, self.env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)

    def start_agent(self, host: str, name: str, devices: int = 2) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "hotspare", "agent", "--coordinator", self.address, "--secret-file",
               self.secret_file, "--devices", f"cpu:{devices}", "--name", name, *self.agent_extra]
        proc = self._popen(self.net[host].ns, cmd, name)
        self.agents[name], self.agent_logs[name] = proc, Output(proc, name if self.echo else None)
        return proc

    def finish(self, timeout: float = 240) -> tuple[int, dict | None]:
        """Wait for the launcher and the agents to end; its exit status and the report."""
        code = self.launcher.wait(timeout=timeout)
        for proc in self.agents.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        report = json.loads(Path(self.report_path).read_text()) if os.path.exists(self.report_path) else None
        return code, report

    def stop(self) -> None:
        for proc in [self.launcher, *self.agents.values()]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
