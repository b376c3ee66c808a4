"""The tests' real single-machine Slurm (slurmctld + slurmd + munge on this host, one node named
``hostname -s``, cluster ``hotspare-ci``), started by ``.ci/slurm-up`` and stopped by
``.ci/slurm-down``. The ``hotspare_slurm_node`` session fixture (tests/conftest.py) starts it when
the binaries are installed but the daemons are not running, and stops only what it started.

The node has the machine's real CPUs (2 on CI). A test job that runs more tasks than that asks
for them with ``--overcommit`` (sbatch -O), which Slurm grants on this cluster as on any other:
one CPU is allocated, and the tasks share it.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from typing import Iterator

from hotspare.testing.local import REPO

TEST_CLUSTER = "hotspare-ci"       # the ClusterName .ci/slurm-up writes
BINARIES = ("slurmctld", "slurmd", "scontrol", "sinfo", "sbatch", "srun", "squeue", "munged")


class SlurmUnavailable(Exception):
    """No test cluster can run here; the message says how to get one (a test fails with it)."""


class NotTestCluster(Exception):
    """A Slurm that is not the throwaway test cluster runs here (a test skips: it leaves it alone)."""


def sh(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def controller_up() -> bool:
    return "is UP" in sh("scontrol", "ping").stdout


def sinfo_state(node: str) -> str:
    return sh("sinfo", "--noheader", "--nodes", node, "--format", "%T").stdout.strip()


def sinfo_reason(node: str) -> str:
    """The node's reason as ``sinfo -R`` lists it (empty when the node has none)."""
    return sh("sinfo", "--list-reasons", "--noheader", "--nodes", node, "--format", "%E").stdout.strip()


def wait_state(node: str, wanted: tuple[str, ...], timeout: float = 30.0) -> str:
    """The node's state once it is one of ``wanted``; AssertionError after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        state = sinfo_state(node)
        if state in wanted:
            return state
        if time.monotonic() > end:
            raise AssertionError(f"node {node} is {state!r}, still not {' or '.join(wanted)} after {timeout:g} s")
        time.sleep(0.2)


@contextmanager
def running_cluster() -> Iterator[str]:
    """The test cluster's one node name, the cluster started if needed (installing the packages
    first on a fresh machine, as root) and stopped afterwards if this call started it."""
    missing = [b for b in BINARIES if not shutil.which(b)]
    if missing and os.geteuid() == 0:      # a fresh machine: install them (apt-get), as CI does
        sh(str(REPO / ".ci" / "slurm-up"), "--install-only", timeout=900)
        missing = [b for b in BINARIES if not shutil.which(b)]
    if missing:
        raise SlurmUnavailable(f"Slurm is not installed here (missing {', '.join(missing)}): run `.ci/slurm-up` "
                               f"as root; it installs slurm-wlm and munge with apt-get and starts a one-node "
                               f"test cluster (.ci/run does this before pytest)")
    started = False
    if not controller_up():
        if os.geteuid() != 0:
            raise SlurmUnavailable("Slurm is installed but its daemons are not running, and starting them "
                                   "needs root: run `sudo .ci/slurm-up`")
        up = sh(str(REPO / ".ci" / "slurm-up"), timeout=300)
        if up.returncode != 0:
            raise SlurmUnavailable(f".ci/slurm-up failed:\n{up.stdout}{up.stderr}")
        started = True
    try:
        config = sh("scontrol", "show", "config").stdout
        cluster = next((line.split("=", 1)[1].strip() for line in config.splitlines()
                        if line.split("=")[0].strip() == "ClusterName"), "?")
        if cluster != TEST_CLUSTER:
            raise NotTestCluster(f"the Slurm running here is cluster {cluster!r}, not the throwaway "
                                 f"{TEST_CLUSTER!r} of .ci/slurm-up: not touching a real cluster")
        yield socket.gethostname().split(".")[0]
    finally:
        if started:
            sh(str(REPO / ".ci" / "slurm-down"), timeout=120)
