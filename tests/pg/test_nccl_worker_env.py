"""The environment a worker of an NCCL job starts with: the node agent writes hotspare's NCCL
variables (pg/nccl.py) into it, forked from the zygote or started fresh, before torch runs there
(``TORCH_NCCL_NONBLOCKING_TIMEOUT`` is read once per process). A real agent, real worker
processes, a real coordinator endpoint; no GPU is needed to see what a worker's environment is."""
import contextlib
import json
import os
import queue
import sys
import time

import pytest

from hotspare.agent import NodeAgent
from hotspare.coordinator.nodes import NodeEndpoint, Nodes
from hotspare.pg.nccl import REQUIRED
from hotspare.protocol.workerenv import JobEnv

SECRET = b"n" * 32
DUMP = "import json, os, sys\njson.dump(dict(os.environ), open(sys.argv[1], 'w'))\n"


@contextlib.contextmanager
def agent_of(tmp_path, job: JobEnv, spawn: str, user: dict[str, str]):
    """A node agent of a job whose one worker writes its environment to a file, and that file."""
    script, out = tmp_path / "dump_env.py", tmp_path / "env.json"
    script.write_text(DUMP)
    base = {k: v for k, v in os.environ.items() if not (k.startswith("TORCH_NCCL_") or k.startswith("NCCL_"))}
    base.update(OMP_NUM_THREADS="1", WORLD_SIZE="1", **job.to_env(), **user)
    nodes = Nodes()
    endpoint = NodeEndpoint(queue.Queue(), SECRET, owner=nodes.owner)
    agent = NodeAgent([sys.executable, str(script), str(out)], base, coordinator=endpoint.address,
                      secret=SECRET, node="n0", spawn=spawn)
    try:
        assert (agent.zygote is not None) == (spawn == "fork")
        yield agent, out
    finally:
        agent.shutdown(grace=0.0)
        endpoint.close()


def worker_env(agent: NodeAgent, out) -> dict[str, str]:
    agent.spawn("w0", "active", 0, None)
    deadline = time.time() + 30
    while time.time() < deadline:
        if out.exists() and out.stat().st_size:
            try:
                return json.loads(out.read_text())
            except json.JSONDecodeError:       # still being written
                pass
        time.sleep(0.02)
    raise AssertionError("the worker did not write its environment in 30 s")


@pytest.mark.parametrize("spawn", ["fork", "exec"])
def test_a_worker_of_an_nccl_job_starts_with_hotspares_nccl_environment(tmp_path, spawn, capfd):
    """A user's TORCH_NCCL_ASYNC_ERROR_HANDLING=3 would let torch kill a survivor with its failed
    peer: replaced (and said once); their NCCL_DEBUG is theirs to keep; the rendezvous bound is
    the job's join timeout."""
    user = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_DEBUG": "INFO"}
    with agent_of(tmp_path, JobEnv(backend="nccl", join_timeout_s=7.0), spawn, user) as (agent, out):
        env = worker_env(agent, out)
        zygote_pid = agent.zygote._proc.pid if agent.zygote is not None else None
        zygote_env = (open(f"/proc/{zygote_pid}/environ", "rb").read().split(b"\0")
                      if zygote_pid is not None else None)
    assert {k: env.get(k) for k in REQUIRED} == REQUIRED
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert env["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "7"
    assert env["NCCL_DEBUG"] == "INFO"
    assert (env["HOTSPARE_BACKEND"], env["RANK"]) == ("nccl", "0")       # the rest of its contract as before
    if zygote_env is not None:        # the zygote, where torch is imported before the fork, too
        assert b"TORCH_NCCL_ASYNC_ERROR_HANDLING=2" in zygote_env
        assert b"TORCH_NCCL_NONBLOCKING_TIMEOUT=7" in zygote_env
    err = capfd.readouterr().err
    assert err.count("TORCH_NCCL_ASYNC_ERROR_HANDLING=3 replaced by 2") == 1, err


def test_a_worker_of_a_gloo_job_gets_no_nccl_variables(tmp_path):
    with agent_of(tmp_path, JobEnv(backend="gloo"), "fork", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}) as (agent, out):
        env = worker_env(agent, out)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"                  # the user's, untouched
    assert not any(k in env for k in REQUIRED if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING")
    assert "TORCH_NCCL_NONBLOCKING_TIMEOUT" not in env and "NCCL_DEBUG" not in env
