"""The coordinator service across network namespaces (``hotspare.testing.netns``), for tests:
``hotspare coordinator`` in the hub, ``hotspare agent`` on hosts, jobs submitted with
``hotspare submit``; every process's output followed line by line (``hostjob.Output``) so a
test waits for what a log says, not for a time."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hotspare.testing.hostjob import Output
from hotspare.testing.local import REPO
from hotspare.testing.netns import Hosts

PORT = 29500


def new_secret_file(directory: str | None = None) -> str:
    """A fresh job secret in a file only its owner may read (what --secret-file wants)."""
    path = os.path.join(directory or tempfile.mkdtemp(), "secret")
    with open(path, "w") as f:
        f.write(os.urandom(32).hex())
    os.chmod(path, 0o600)
    return path


def borrower_recovered(row: dict, report: dict, log: str, reference: str, steps: int, on: str) -> dict:
    """A borrowing job's end, checked: finished, bitwise equal to its fault-free run (``reference``),
    every step once, its one lost rank (1) recovered from memory by a worker on the borrowed host
    ``on``. Its one loan record."""
    assert row["state"] == "finished" and row["code"] == 0, log
    assert report["final_state_digest"] == reference, "the borrower diverged from its fault-free run"
    assert report["steps_completed"] == steps and report["steps_lost"] == 0 and report["steps_repeated"] == 0
    (failure,) = report["failures"]
    assert failure["rank"] == 1 and failure["recovery_path"] == "memory" and failure["lost_steps"] == 0
    assert failure["replacement"] in {w["worker"] for w in report["nodes"][on]["workers"]}
    (loan,) = report["loans"]
    return loan


class ServiceCluster:
    def __init__(self, net: Hosts, secret_file: str, state_dir: str, lease: float = 2.0, margin: float = 1.0,
                 env: dict[str, str] | None = None, echo: bool = False, allow_inject: bool = False):
        """``allow_inject``: the service and every agent load the fault plug-in (`hotspare inject`)."""
        self.net, self.secret_file, self.state_dir = net, secret_file, state_dir
        self.lease, self.margin, self.echo, self.allow_inject = lease, margin, echo, allow_inject
        self.env = {"PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO)), "OMP_NUM_THREADS": "1", **(env or {})}
        self.address = f"{net.hub_addr}:{PORT}"
        self.services: list[Output] = []
        self.agents: dict[str, Output] = {}
        self.start_service()

    @property
    def log(self) -> Output:
        """The output of the service running now (the last one started)."""
        return self.services[-1]

    def _popen(self, ns: str, cmd: list[str], tag: str) -> Output:
        proc = subprocess.Popen(self.net.argv(ns, cmd, self.env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        return Output(proc, tag if self.echo else None)

    def start_service(self) -> Output:
        cmd = [sys.executable, "-m", "hotspare", "coordinator", "--listen", self.address, "--state", self.state_dir,
               "--secret-file", self.secret_file, "--node-lease", str(self.lease), "--lease-margin", str(self.margin),
               *(["--allow-inject"] if self.allow_inject else [])]
        out = self._popen(self.net.hub, cmd, f"service{len(self.services)}")
        self.services.append(out)
        out.wait_for(r"coordinator service on", 60)
        return out

    def kill_service(self) -> None:
        """``kill -9`` the service: no goodbye to anyone."""
        proc = self.log.proc
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def start_agent(self, host: str, devices: int = 2, spare: bool = False, name: str | None = None) -> Output:
        """An agent on ``host``, registered as ``name`` (default: the host's name)."""
        name = name or host
        cmd = [sys.executable, "-m", "hotspare", "agent", "--coordinator", self.address, "--secret-file",
               self.secret_file, "--devices", f"cpu:{devices}", "--name", name, *(["--spare"] if spare else []),
               *(["--allow-inject"] if self.allow_inject else [])]
        out = self._popen(self.net[host].ns, cmd, name)
        self.agents[name] = out
        self.log.wait_for(rf"NODE    {name}: registered", 60)
        return out

    def client(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """`hotspare ARGS...` against the service, run from the hub."""
        cmd = [sys.executable, "-m", "hotspare", *args[:1], "--coordinator", self.address, "--secret-file",
               self.secret_file, *args[1:]]
        return subprocess.run(self.net.argv(self.net.hub, cmd, self.env), capture_output=True, text=True,
                              timeout=timeout)

    def submit(self, nodes: int, per_node: int, spares: int, script: str, script_args: list[str],
               run_args: list[str] = ()) -> str:
        done = self.client("submit", "--nodes", str(nodes), "--nproc-per-node", str(per_node), "--spares",
                           str(spares), *run_args, "--", script, *script_args)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout.split()[2]              # "hotspare submit: j1 queued"

    def inject(self, job: str, spec: str) -> str:
        """`hotspare inject` into the service's ``job``; what it printed."""
        done = self.client("inject", "--job", job, spec)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def status(self, job: str | None = None) -> dict:
        done = self.client("status", *([job] if job else []), "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout)

    def wait_job(self, job: str, timeout: float = 240) -> tuple[dict, dict | None]:
        """Wait until ``job`` ended; its status row and its report."""
        deadline = time.time() + timeout
        report = Path(self.state_dir).parent / f"{job}-report.json"
        while time.time() < deadline:
            row = self.status(job)["jobs"][0]
            if row["state"] in ("finished", "stopped", "cancelled"):
                done = self.client("status", job, "--report", str(report))
                assert done.returncode == 0, done.stderr
                return row, json.loads(report.read_text()) if report.exists() else None
            time.sleep(1.0)
        raise AssertionError(f"job {job} did not end within {timeout:.0f} s:\n{self.log.text()}")

    def worker_pids(self, host: str, rank: int | None = None, role: str = "active") -> list[int]:
        """The workers on ``host`` (of ``rank``, if given), from their environment."""
        found = []
        for pid in self.net.pids(self.net[host].ns):
            try:
                env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
            except OSError:
                continue
            if env.get("HOTSPARE_ROLE") == role and (rank is None or env.get("RANK") == str(rank)):
                found.append(pid)
        return found

    def close(self) -> None:
        for out in [*self.services, *self.agents.values()]:
            if out.proc.poll() is None:
                out.proc.kill()
                out.proc.wait()
