"""The coordinator service on loopback, for the tests of tests/service: the service in this
process (its own thread, its log kept line by line), real `hotspare agent` processes named as
hosts, real jobs of the example GPT. A test waits for what a log says, not for a time."""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from hotspare.cli.jobs import request
from hotspare.protocol import auth
from hotspare.service.service import Service
from hotspare.testing.hostjob import Output
from hotspare.testing.local import EXAMPLE, REPO

ENDED = ("finished", "stopped", "cancelled")


class Log:
    def __init__(self):
        self.lines: list[str] = []
        self._cond = threading.Condition()

    def __call__(self, line: str) -> None:
        with self._cond:
            self.lines.append(line)
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        rx, deadline, seen = re.compile(pattern), time.time() + timeout, 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if m := rx.search(line):
                        return m
                seen = len(self.lines)
                if time.time() >= deadline:
                    raise AssertionError(f"no line matching {pattern!r} within {timeout:.0f} s:\n{self.text()}")
                self._cond.wait(0.5)

    def text(self) -> str:
        with self._cond:
            return "\n".join(self.lines)


class Loopback:
    """One service and its agents on 127.0.0.1."""

    def __init__(self, state_dir: str, secret_file: str, **service_kw):
        self.secret_file, self.log = secret_file, Log()
        self.svc = Service("127.0.0.1", 0, auth.load_secret(secret_file), secret_file, state_dir, log=self.log,
                           **service_kw)
        self._thread = threading.Thread(target=self.svc.serve, name="service", daemon=True)
        self._thread.start()
        self.agents: dict[str, Output] = {}
        self.cli = argparse.Namespace(coordinator=self.svc.address, secret_file=secret_file)

    def start_agent(self, name: str, devices: int = 2, spare: bool = False) -> Output:
        env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO)), "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "hotspare", "agent", "--coordinator", self.svc.address,
                                 "--secret-file", self.secret_file, "--devices", f"cpu:{devices}", "--name", name,
                                 *(["--spare"] if spare else [])], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.agents[name] = Output(proc)
        self.log.wait_for(rf"NODE    {name}: registered", 60)
        return self.agents[name]

    def request(self, command: str, **fields) -> dict:
        return request(self.cli, command, **fields)

    def submit(self, steps: int = 3, nodes: int = 1, per_node: int = 2, spares: int = 0,
               run_args: list[str] = ()) -> str:
        return self.request("submit", script=str(EXAMPLE), args=["--model", "tiny", "--steps", str(steps)],
                            nodes=nodes, nproc_per_node=per_node, spares=spares, run_args=list(run_args))["job"]

    def row(self, job: str) -> dict:
        return self.request("status", job=job)["jobs"][0]

    def wait_ended(self, job: str, timeout: float = 120) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            row = self.row(job)
            if row["state"] in ENDED:
                return row
            time.sleep(0.3)
        raise AssertionError(f"job {job} did not end within {timeout:.0f} s:\n{self.log.text()}")

    def host_states(self) -> dict[str, str]:
        return {h["name"]: h["state"] for h in self.request("status")["hosts"]}

    def wait_hosts(self, want: dict[str, str], timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while self.host_states() != want:
            if time.time() > deadline:
                raise AssertionError(f"hosts {self.host_states()}, not {want}:\n{self.log.text()}")
            time.sleep(0.2)

    def close(self) -> None:
        for out in self.agents.values():
            if out.proc.poll() is None:
                os.killpg(out.proc.pid, signal.SIGKILL)
                out.proc.wait()
        self.svc.stop()
        self._thread.join(timeout=10)
        self.svc.db.close()


def workers_of(job: str, agent: Output) -> list[int]:
    """The processes under ``agent`` that are workers of the service's ``job`` (from their environment)."""
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found = []
    for pid in parent:
        up, seen = pid, 0
        while up in parent and up != agent.proc.pid and seen < 64:
            up, seen = parent[up], seen + 1
        if up != agent.proc.pid or pid == agent.proc.pid:
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"TORCHELASTIC_RUN_ID={job}".encode() in env and any(v.startswith(b"HOTSPARE_ROLE=") for v in env):
            found.append(pid)
    return found
