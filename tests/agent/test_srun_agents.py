"""examples/slurm/hotspare.sbatch, submitted as it is to the suite's real one-machine Slurm
(hotspare/testing/slurm.py): the launcher in the batch script, 3 `hotspare agent` tasks by srun,
each naming itself from Slurm's environment (vm.0, vm.1, vm.2: 3 tasks on the one node) with one
slot per CPU of its task (-c 2). The job must end 0, bitwise equal to the same job on one host
without Slurm; with one agent's task killed mid-run (its node lost), the other tasks go on and
the spares finish the job, still bitwise equal.

The only changes to the script's own #SBATCH lines are those one machine forces: 1 node with 3
tasks instead of 3 nodes with 1, and HOME in the test's directory (the secret is written there).
About 30 s each on 2 cores: marked slow (CI runs -m slow)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hotspare.testing import run_job
from hotspare.testing.local import EXAMPLE, REPO
from hotspare.testing.slurm import sh

pytestmark = pytest.mark.slow
SBATCH = REPO / "examples" / "slurm" / "hotspare.sbatch"
STEPS = 200
ARGS = ["--model", "tiny", "--steps", str(STEPS)]
AGENTS = 3


@pytest.fixture(scope="module")
def reference():
    """The same job on one host, without Slurm and without faults."""
    result = run_job(ARGS, nproc=4, spares=2)
    assert result.code == 0, result.output
    return result.digest


class BatchJob:
    def __init__(self, tmp: Path, run_args: str | None = None):
        self.tmp = tmp
        bin_dir = tmp / "bin"                    # `hotspare` on PATH, as an installed one would be
        bin_dir.mkdir()
        (bin_dir / "hotspare").write_text(f'#!/bin/sh\nexec {sys.executable} -m hotspare "$@"\n')
        (bin_dir / "hotspare").chmod(0o755)
        self.home, self.out, self.report = tmp / "home", tmp / "job.out", tmp / "report.json"
        self.home.mkdir()
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM")},
               "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(self.home), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO)), "REPORT": str(self.report)}
        if run_args is not None:
            env["RUN_ARGS"] = run_args
        cmd = ["sbatch", "--parsable", "--nodes", "1", "--ntasks-per-node", str(AGENTS), "--chdir", str(tmp),
               "--output", str(self.out), str(SBATCH), str(EXAMPLE), *ARGS]
        sub = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
        assert sub.returncode == 0, sub.stderr
        self.id = sub.stdout.strip().split(";")[0]

    def text(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    def wait_for(self, needle: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        while needle not in self.text():
            assert time.monotonic() < end and self.state() in ("PENDING", "RUNNING", "CONFIGURING"), \
                f"no {needle!r} in job {self.id}'s output ({self.state()}):\n{self.text()}"
            time.sleep(0.2)
        return self.text()

    def job_fields(self) -> dict[str, str]:
        shown = sh("scontrol", "show", "job", self.id).stdout
        return dict(item.split("=", 1) for item in shown.split() if "=" in item)

    def state(self) -> str:
        return self.job_fields().get("JobState", "?")

    def finish(self, timeout: float = 240) -> tuple[dict[str, str], dict | None]:
        end = time.monotonic() + timeout
        while self.state() in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            assert time.monotonic() < end, f"job {self.id} still {self.state()} after {timeout:.0f} s:\n{self.text()}"
            time.sleep(0.5)
        report = json.loads(self.report.read_text()) if self.report.exists() else None
        return self.job_fields(), report

    def cancel(self) -> None:
        sh("scancel", self.id)


@pytest.fixture
def batch(hotspare_slurm_node, tmp_path):
    jobs = []

    def submit(**kw):
        jobs.append(BatchJob(tmp_path, **kw))
        return jobs[-1]
    yield submit
    for job in jobs:
        job.cancel()


def assert_equal_to_reference(report, reference, failures):
    assert report["final_state_digest"] == reference, "the Slurm run diverged from the one-host run"
    assert report["steps_completed"] == STEPS and report["replicas_consistent"]
    assert report["steps_repeated"] == 0 and report["steps_lost"] == 0
    assert report["failures_total"] == failures and report["recovered_zero_loss"] == failures


def test_srun_agents_named_by_slurm_run_the_job_bitwise_equal_to_one_host(batch, hotspare_slurm_node, reference):
    node = hotspare_slurm_node
    job = batch()
    fields, report = job.finish()
    out = job.text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), out
    assert report is not None, out
    assert_equal_to_reference(report, reference, 0)
    names = [f"{node}.{i}" for i in range(AGENTS)]
    assert sorted(report["nodes"]) == names, "the agents' names are not Slurm's node name and local id"
    assert all(len(report["nodes"][n]["workers"]) == 2 for n in names), report["nodes"]
    for i, name in enumerate(names):
        assert f"hotspare agent {name}: node name {name} from SLURMD_NODENAME={node}, SLURM_LOCALID={i}" in out
        assert f"hotspare agent {name}: devices cpu:2 from SLURM_CPUS_PER_TASK=2" in out
    assert "launcher exited 0, agents' step 0" in out
    # the per-job secret lived in the (shared) home, private, and is gone with the job
    hs = job.home / ".hotspare"
    assert hs.is_dir() and hs.stat().st_mode & 0o777 == 0o700
    assert not list(hs.glob("job-*.secret"))


def _tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def test_an_agent_task_killed_mid_run_leaves_the_others_running_and_the_spares_finish(
        batch, hotspare_slurm_node, reference):
    job = batch(run_args="--node-lease 3 --lease-margin 1 --hang-floor 10 --log-every 10")
    out = job.wait_for("step    40/", 120)
    # the first agent to connect holds ranks 0 and 1 (placement follows the connection order)
    first, pid = re.search(r"NODE    (\S+): agent pid (\d+) connected", out).groups()
    killed = _tree(int(pid))               # the agent, its zygote and its workers: a host dying
    for p in killed:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert len(killed) >= 3
    fields, report = job.finish()
    out = job.text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), out
    assert_equal_to_reference(report, reference, 2)
    assert report["nodes"][first]["lost"] and sum(v["lost"] for v in report["nodes"].values()) == 1
    assert {f["rank"] for f in report["failures"]} == {0, 1}
    assert all(f["kind"] == "node lost" and f["lost_steps"] == 0 for f in report["failures"])
    # the batch script's exit is the launcher's; the agents' step failed with the killed task
    assert re.search(r"launcher exited 0, agents' step [1-9]\d*", out), out
