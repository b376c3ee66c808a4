"""The node agent <-> coordinator link: real agent, real worker processes, real sockets.

The coordinator's side is driven here by hand (``NodeEndpoint`` events, ``Nodes`` commands), so
each message of the protocol is seen to do what it says, and bad input is seen to be refused
without harming anything else."""
import contextlib
import json
import os
import queue
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from hotspare.agent import NodeAgent
from hotspare.coordinator import events as ev
from hotspare.coordinator.nodes import NodeEndpoint, Nodes
from hotspare.protocol.channel import Channel
from hotspare.protocol.messages import make
from hotspare.testing.faults import AgentFaults, Arming

WORKER = [sys.executable, str(Path(__file__).resolve().parents[1] / "scripts" / "echo_worker.py")]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2"}


def next_event(events, types, timeout=20.0, skipped=None):
    """The next event of one of ``types`` (``coordinator.events``); the others are dropped (or
    appended to ``skipped``)."""
    deadline = time.time() + timeout
    while True:
        event = events.get(timeout=max(0.01, deadline - time.time()))
        if isinstance(event, tuple(types)):
            return event
        if skipped is not None:
            skipped.append(event)


SECRET = b"s" * 32


@contextlib.contextmanager
def _linked(spawn):
    events: queue.Queue = queue.Queue()
    nodes = Nodes()
    endpoint = NodeEndpoint(events, SECRET, owner=nodes.owner)
    agents = []

    def connect(node, devices=None, faults=None):
        agent = NodeAgent(WORKER, ENV, coordinator=endpoint.address, secret=SECRET, node=node, devices=devices,
                          spawn=spawn, faults=faults)
        assert (agent.zygote is not None) == (spawn == "fork")
        agents.append(agent)
        return agent

    try:
        yield events, endpoint, nodes, connect
    finally:
        for agent in agents:
            agent.shutdown(grace=0.0)
        endpoint.close()


@pytest.fixture(params=["fork", "exec"])
def link(request):
    """Each test twice: workers forked from the agent's zygote, and started as fresh interpreters."""
    with _linked(request.param) as parts:
        yield parts


@pytest.fixture
def fork_link():
    with _linked("fork") as parts:
        yield parts


def join(events, nodes, name):
    e = next_event(events, {ev.NodeConnected})
    assert e.node == name and e.hello["type"] == "agent_hello"
    return nodes.add(e.hello, e.channel)


def test_spawn_relay_deliver_kill(link):
    events, _, nodes, connect = link
    connect("n0", devices=["n0/cpu0", "n0/cpu1"])
    node = join(events, nodes, "n0")
    assert node.devices == ["n0/cpu0", "n0/cpu1"] and not node.device_faults

    w = nodes.spawn("active", rank=0)
    assert nodes.workers[w].device == "n0/cpu0" and nodes.free_devices() == ["n0/cpu1"]
    e = next_event(events, {ev.WorkerStarted})
    nodes.observe(e)
    assert e.worker == w and nodes.workers[w].pid > 0
    e = next_event(events, {ev.WorkerSaid})
    assert (e.worker, e.type, e.msg["device"]) == (w, "ready", "n0/cpu0")
    assert e.msg["env"] == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "HOTSPARE_DEVICE": "n0/cpu0"}

    assert nodes.send(w, make("probe", gen=3))            # down to the worker, and its answer up
    e = next_event(events, {ev.WorkerSaid})
    assert (e.worker, e.type, e.msg["gen"], e.msg["step"]) == (w, "reducing", 3, 7)

    nodes.kill(w, signal.SIGKILL)
    e = next_event(events, {ev.WorkerExited})
    nodes.observe(e)
    assert e.worker == w and e.code == -signal.SIGKILL
    assert nodes.alive() == [] and nodes.free_devices() == ["n0/cpu0", "n0/cpu1"]


def test_a_stopped_then_continued_worker_is_reported_as_the_kernel_says_it(link):
    """SIGSTOP and SIGCONT reach the coordinator as they happen (the agent's waitpid sees them;
    nothing polls /proc), and the exit after them still carries its signal."""
    events, _, nodes, connect = link
    connect("n0", devices=["n0/cpu0"])
    join(events, nodes, "n0")
    w = nodes.spawn("active", rank=0)
    assert next_event(events, {ev.WorkerSaid}).type == "ready"
    for sig, stopped in ((signal.SIGSTOP, True), (signal.SIGCONT, False), (signal.SIGSTOP, True)):
        t0 = nodes.kill(w, sig)
        e = next_event(events, {ev.WorkerStopped})
        nodes.observe(e)
        assert e.worker == w and e.stopped is stopped and nodes.workers[w].stopped is stopped
        assert time.time() - t0 < 2.0
    nodes.kill(w, signal.SIGKILL)                       # a stopped process dies of SIGKILL too
    e = next_event(events, {ev.WorkerExited})
    assert (e.worker, e.code) == (w, -signal.SIGKILL)


def test_agent_refuses_bad_commands_and_goes_on(link):
    events, _, nodes, connect = link
    connect("n0", devices=["n0/cpu0"], faults=AgentFaults())     # the fault plug-in: "arm" is a command
    node = join(events, nodes, "n0")
    bad = [make("spawn", worker="x1", role="spare", rank=None, device="n9/cpu7"),   # not its device
           make("kill", worker="nobody", signal=9, group=True),
           make("kill", worker="x1", signal=12345, group=True),                   # no such signal
           make("deliver", worker="x1", msg={"v": 1, "type": "probe"}),           # a bad inner message
           make("arm", id=1, spec="kill:rank=1:step=oops", running=False),
           make("probe", gen=1)]                                                   # not an agent command
    for msg in bad:
        node.channel.send(msg)
    node.channel.sock.sendall(b'{"v": 1, "type": "spawn"}\nnot json\n')
    said = [next_event(events, {ev.AgentRefused}) for _ in range(len(bad) + 2)]
    assert [e.command for e in said] == ["spawn", "kill", "kill", "deliver", "arm", "probe", "?", "?"]
    text = " | ".join(e.message for e in said)
    for what in ("'n9/cpu7' is not one of node n0's", "no worker nobody", "12345 is not a valid Signals",
                 "lacks field 'gen'",
                 "must be an integer", "not a command for a node agent", "lacks field 'worker'",
                 "not valid JSON"):
        assert what in text, text
    w = nodes.spawn("spare")                                 # the link still works
    e = next_event(events, {ev.WorkerSaid})
    assert (e.worker, e.type) == (w, "ready")
    nodes.send(w, make("release", reason="test over"))
    e = next_event(events, {ev.WorkerExited})
    assert (e.worker, e.code) == (w, 0)


def test_endpoint_refuses_strangers_and_bad_lines(link):
    events, endpoint, nodes, connect = link
    host, port = endpoint.address.rsplit(":", 1)
    stranger = Channel.connect(host, int(port))                 # not an agent: refused, told why
    assert stranger.recv()["type"] == "challenge"
    stranger.send(make("probe", gen=1))
    reply = stranger.recv()
    assert reply["type"] == "refused" and "agent_hello" in reply["message"]
    assert stranger.recv() is None
    old = socket.create_connection((host, int(port)))           # another protocol version
    old.sendall(json.dumps({"v": 0, "type": "agent_hello"}).encode() + b"\n")
    lines = old.makefile("rb")
    assert b"challenge" in lines.readline()
    assert b"protocol version 0 is not this listener's 1" in lines.readline()
    old.close()

    agent = connect("n0")
    node = join(events, nodes, "n0")
    agent.uplink.sock.sendall(b"garbage\n" + json.dumps(
        {"v": 1, "type": "relay", "worker": "w9", "t": 1.0, "msg": {"v": 1, "type": "nope"}}).encode() + b"\n")
    agent.uplink.send(make("spawn", worker="w9", role="spare", rank=None, device=None))   # wrong way
    w = nodes.spawn("spare")                 # the link survives all three: the next event is real
    e = next_event(events, {ev.WorkerStarted, ev.WorkerSaid, ev.AgentRefused})
    assert (type(e), e.worker) == (ev.WorkerStarted, w)
    assert node.name == "n0" and not node.lost


def test_a_lost_link_loses_its_workers_and_the_agent_ends_them(link):
    events, _, nodes, connect = link
    agent = connect("n0")
    node = join(events, nodes, "n0")
    w = nodes.spawn("spare")
    nodes.observe(next_event(events, {ev.WorkerStarted}))
    pid = nodes.workers[w].pid
    node.channel.close()                     # the coordinator goes away: the agent ends its workers
    deadline = time.time() + 20
    while agent.alive() and time.time() < deadline:
        time.sleep(0.05)
    assert agent.alive() == []
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert next_event(events, {ev.NodeLost}).node == "n0"
    assert nodes.lose("n0") == [w] and nodes.spawn("spare") is None   # nothing left to place on


def test_faults_go_to_every_node_and_fire_once(link):
    """The fault plug-in on both sides (hotspare.testing.faults): armed on every node, fired by
    the one whose worker holds the rank, at the trigger, which waits for the agent's go."""
    events, _, nodes, connect = link
    fa, fb = AgentFaults(), AgentFaults()
    a = connect("a", devices=["a/cpu0"], faults=fa)
    connect("b", devices=["b/cpu0"], faults=fb)
    arming = Arming(nodes)
    ident = arming.arm("kill:rank=1:step=5", running=False)    # before the nodes connect
    for _ in range(2):
        e = next_event(events, {ev.NodeConnected})
        nodes.add(e.hello, e.channel)
        arming.node_joined(e.node)                             # each gets the fault as it joins
    w0, w1 = nodes.spawn("active", rank=0), nodes.spawn("active", rank=1)
    assert (nodes.workers[w0].node, nodes.workers[w1].node) == ("a", "b")
    # Both workers are watched and say step 5 begins; only rank 1 (on b) matches.
    skipped = []
    e = next_event(events, {ev.FaultInjected}, skipped=skipped)
    assert (e.worker, e.fault, e.ident) == (w1, "kill:rank=1:step=5", ident)
    assert fa.injector.pending() and not fb.injector.pending()
    assert a.job_env.faults and a.job_env.to_env()["HOTSPARE_FAULTS"] == "1"   # the worker side loads its plug-in

    def said(who, step):
        return any(isinstance(x, ev.WorkerSaid) and (x.worker, x.msg.get("step")) == (who, step) for x in skipped)
    # a still watches (its copy is armed) until rank 0 has said step 5 begins
    while not said(w0, 5):
        skipped.append(next_event(events, {ev.WorkerSaid}, skipped=skipped))
    arming.fired(ident, e.worker)                              # a drops its copy
    exits = [x for x in skipped if isinstance(x, ev.WorkerExited)]
    gone = exits[0] if exits else next_event(events, {ev.WorkerExited}, skipped=skipped)
    assert (gone.worker, gone.code) == (w1, -signal.SIGKILL)    # a real SIGKILL
    deadline = time.time() + 10
    while fa.injector.pending() and time.time() < deadline:
        time.sleep(0.02)
    assert not fa.injector.pending() and ident not in arming.armed
    assert w0 in a.alive()
    # The trigger waited for the agent: rank 0 went on to step 6 once told to; rank 1 died at 5.
    while not said(w0, 6):
        skipped.append(next_event(events, {ev.WorkerSaid}))
    assert said(w1, 5) and not said(w1, 6)


def test_without_the_fault_plug_in_an_agent_refuses_arm_and_tells_workers_nothing(link):
    events, _, nodes, connect = link
    agent = connect("n0", devices=["n0/cpu0"])
    node = join(events, nodes, "n0")
    assert not node.device_faults and agent.faults is None and "HOTSPARE_FAULTS" not in agent.base_env
    node.channel.send(make("arm", id=0, spec="kill:rank=0:step=1", running=False))
    e = next_event(events, {ev.AgentRefused})
    assert (e.command, e.message) == ("arm", "'arm' is not a command for a node agent")
    w = nodes.spawn("active", rank=0)
    assert next_event(events, {ev.WorkerSaid}).type == "ready"
    nodes.send(w, make("probe", gen=1))        # the next thing it says answers this: no step was watched
    e = next_event(events, {ev.WorkerSaid})
    assert e.type == "reducing"


def test_coordinator_counts_a_lost_nodes_ranks_as_failed_and_replaces_them(link):
    """Two nodes; node a's agent loses its link (as when its host dies). The coordinator counts
    a's rank as lost with it and forms the next generation with the spare on node b; a's agent,
    cut off from its coordinator, ends its workers."""
    from hotspare.coordinator import Coordinator, Ledger
    from hotspare.policy.decide import ClusterView
    events, _, nodes, connect = link
    lines = []
    view = ClusterView(world_size=2, target_spares=1)
    coord = Coordinator(nodes, events, view, Ledger({}), log=lines.append)
    a = connect("a", devices=["a/cpu0"])
    deadline = time.time() + 20
    while not nodes.nodes and time.time() < deadline:
        coord.step(0.05)
    connect("b", devices=["b/cpu0", "b/cpu1"])
    coord.start(nodes=2)                     # first fit: rank 0 on a, rank 1 and the spare on b
    while view.generation < 1 and time.time() < deadline:
        coord.step(0.05)
    assert view.generation == 1, lines
    doomed, spare = view.members[0], next(w for w in nodes.alive() if view.rank_of(w) is None)
    assert (nodes.workers[doomed].node, nodes.workers[view.members[1]].node, nodes.workers[spare].node) \
        == ("a", "b", "b")
    pid = nodes.workers[doomed].pid

    a.uplink.close()                         # the link to a is gone
    while view.generation < 2 and time.time() < deadline:
        coord.step(0.05)
    assert view.generation == 2, lines
    assert view.members[0] == spare          # the spare on b took a's rank
    assert "NODE    a: the link to its agent closed; 1 worker(s) lost with it" in lines, lines
    f = coord.ledger.failures[0]
    assert (f.kind, f.rank, f.worker) == ("node lost", 0, doomed)
    while a.alive() and time.time() < deadline:    # a's agent ended its orphaned worker
        time.sleep(0.05)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    coord.stop_nodes(grace=0.0)


def test_a_second_agent_with_a_taken_name_is_refused_and_the_first_goes_on(link):
    from hotspare.coordinator import Coordinator, Ledger
    from hotspare.policy.decide import ClusterView
    events, _, nodes, connect = link
    lines = []
    coord = Coordinator(nodes, events, ClusterView(world_size=1, target_spares=0), Ledger({}), log=lines.append)
    connect("n0")
    deadline = time.time() + 20
    while "n0" not in nodes.nodes and time.time() < deadline:
        coord.step(0.05)
    first = nodes.nodes["n0"]
    dup = connect("n0")
    while not dup._closed.is_set() and time.time() < deadline:   # refused, cut off: it closes
        coord.step(0.05)
    for _ in range(10):                                          # its link's end reaches the coordinator
        coord.step(0.05)
    assert any(line.startswith("NODE    refused an agent: a node named 'n0' is already connected")
               for line in lines), lines
    assert nodes.nodes["n0"] is first and not first.lost
    assert not any("link to its agent closed" in line for line in lines), lines


def test_a_lost_zygote_leaves_the_agent_starting_fresh_interpreters(fork_link):
    events, _, nodes, connect = fork_link
    agent = connect("n0", devices=["n0/cpu0", "n0/cpu1"])
    join(events, nodes, "n0")
    first = nodes.spawn("spare")
    e = next_event(events, {ev.WorkerSaid})
    assert (e.worker, e.type) == (first, "ready")
    agent.zygote._proc.kill()                   # the zygote dies; the job must not notice
    second = nodes.spawn("spare")
    e = next_event(events, {ev.WorkerSaid})
    assert (e.worker, e.type) == (second, "ready") and agent.zygote is None
    for w in (first, second):                   # both are the agent's, whichever way they started
        nodes.kill(w, signal.SIGKILL)
        assert next_event(events, {ev.WorkerExited}).code == -signal.SIGKILL


def test_an_unknown_spawn_method_is_refused_before_anything_starts():
    from hotspare.errors import ConfigError
    with pytest.raises(ConfigError, match="spawn method 'clone' unknown; use one of fork, exec"):
        NodeAgent(WORKER, ENV, coordinator="127.0.0.1:1", secret=SECRET, spawn="clone")
