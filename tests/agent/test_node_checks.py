"""Device checks as node-agent commands: the agent runs admission and quarantine diagnostics in
check worker processes on its node and answers with ``checked``; the coordinator's side imports
no torch for them. Real agent, real check workers, real sockets."""
import json
import os
import queue
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hotspare.agent import NodeAgent
from hotspare.coordinator import events as ev
from hotspare.coordinator.nodes import NodeEndpoint, Nodes
from hotspare.protocol.messages import make

REPO = Path(__file__).resolve().parents[2]
SECRET = b"s" * 32
DEVICES = ["n1/cpu0", "n1/cpu1"]


def next_event(events, types, timeout=60.0):
    deadline = time.time() + timeout
    while True:
        event = events.get(timeout=max(0.01, deadline - time.time()))
        if isinstance(event, tuple(types)):
            return event


@pytest.fixture
def linked():
    events: queue.Queue = queue.Queue()
    nodes = Nodes()
    endpoint = NodeEndpoint(events, SECRET, owner=nodes.owner)
    agent = NodeAgent([sys.executable, "-c", "pass"], {**os.environ, "OMP_NUM_THREADS": "1"},
                      coordinator=endpoint.address, secret=SECRET, node="n1", devices=DEVICES, spawn="exec")
    e = next_event(events, {ev.NodeConnected})
    nodes.add(e.hello, e.channel)
    try:
        yield events, nodes, agent
    finally:
        agent.shutdown(grace=0.0)
        endpoint.close()


def test_the_launcher_side_runs_diagnostics_on_the_node_without_importing_torch(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "checks_on_node.py"),
                          str(tmp_path / "health.json")], capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["state"] == "healthy", result["lines"]
    assert sum("diagnostics pass" in line for line in result["lines"]) == 2, result["lines"]
    assert any("burn-in ok; memory ok" in line for line in result["lines"]), result["lines"]
    assert result["torch"] is False, "the coordinator's process imported torch for health work"


def test_admission_runs_on_the_node_and_answers_each_device(linked):
    events, nodes, _agent = linked
    assert nodes.tell("n1", make("admit", devices=DEVICES, size="small"))
    verdicts = {}
    while len(verdicts) < 2:
        e = next_event(events, {ev.DeviceChecked}, timeout=120)
        verdicts[e.device] = e
    assert all(v.stage == "admission" and v.passed and not v.cancelled for v in verdicts.values()), verdicts
    assert "throughput ok" in verdicts[DEVICES[0]].detail and "collective ok" in verdicts[DEVICES[0]].detail


def test_a_device_of_another_node_is_refused(linked):
    events, nodes, agent = linked
    nodes.tell("n1", make("diagnose", device="n2/cpu0", size="small"))
    e = next_event(events, {ev.AgentRefused})
    assert e.command == "diagnose" and "not one of this node's" in e.message
    assert agent.checks.busy() == []


def test_closing_the_agent_cuts_a_running_diagnostics_short(linked):
    events, nodes, agent = linked
    nodes.tell("n1", make("diagnose", device=DEVICES[1], size="full"))    # a 30 s burn-in on CPU
    deadline = time.time() + 30
    while not _check_workers(agent) and time.time() < deadline:
        time.sleep(0.1)
    assert _check_workers(agent), "no check worker process started"
    t0 = time.monotonic()
    agent.shutdown(grace=0.0)
    e = next_event(events, {ev.DeviceChecked}, timeout=10)
    assert time.monotonic() - t0 < 10, "shutdown waited for the burn-in"
    assert (e.device, e.cancelled, e.passed) == (DEVICES[1], True, False)
    assert not _check_workers(agent) and agent.checks.busy() == []


def _check_workers(agent) -> list[int]:
    """Pids of this process's children running a check worker."""
    out = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "hotspare.health.checks.worker"],
                         capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]
