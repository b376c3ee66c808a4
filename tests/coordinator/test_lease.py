"""Node leases on real sockets and threads (no namespaces): the coordinator declares a silent
node lost after lease + margin; the agent fences itself when its renewals go unanswered, and
always before the coordinator can declare it lost; a welcome without the job secret's proof
runs nothing; a node declared lost cannot come back under its name."""
import queue
import threading
import time

import pytest

from hotspare.coordinator.events import NodeConnected, NodeLost
from hotspare.agent.lease import AgentLease, valid_until
from hotspare.protocol.netif import gloo_interface
from hotspare.agent.remote import parse_devices, serve
from hotspare.config import RunConfig
from hotspare.config.run import HostsConfig, LaunchConfig
from hotspare.coordinator.lease import overdue
from hotspare.coordinator.nodes import NodeEndpoint, Nodes
from hotspare.coordinator.remote import remote_endpoint
from hotspare.errors import ConfigError, ProtocolError
from hotspare.protocol import auth
from hotspare.protocol.lease import welcome_proof
from hotspare.protocol.messages import make

SECRET = b"k" * 32


def test_lease_arithmetic():
    assert not overdue(10.0, 13.9, lease=3, margin=1) and overdue(10.0, 14.1, lease=3, margin=1)
    # the agent's lease runs from the send, the coordinator's from the receipt, plus a margin
    sent, received = 10.0, 10.4
    assert valid_until(sent, 3) < received + 3 + 1


def connect(address, node="n1", nonce="00ff"):
    return auth.connect(address, auth.NODE, auth.node_key(SECRET), node=node, pid=1, devices=[],
                        device_faults=False, nonce=nonce)


def test_a_silent_node_is_declared_lost_after_lease_plus_margin_and_its_link_closed():
    events, said = queue.Queue(), []
    ep = remote_endpoint(events, SECRET, lambda w: None, "127.0.0.1", 0, 0.4, 0.2, "train.py", ["--x"],
                         {"MASTER_ADDR": "127.0.0.1"}, said.append)
    try:
        ch = connect(ep.address)
        welcome = ch.recv()
        assert welcome["type"] == "welcome" and welcome["proof"] == welcome_proof(SECRET, "n1", "00ff")
        assert (welcome["script"], welcome["args"], welcome["lease"]) == ("train.py", ["--x"], 0.4)
        joined = events.get(timeout=5)
        assert isinstance(joined, NodeConnected) and joined.node == "n1"
        for seq in range(4):                    # renewed: not lost
            ch.send(make("renew", seq=seq))
            assert ch.recv() == make("renewed", seq=seq)
            last = time.time()
            time.sleep(0.2)
        assert events.empty()
        lost = events.get(timeout=5)            # then silence: lost 0.4 + 0.2 s on, once
        assert lost == NodeLost("n1", joined.channel, lost.t) and 0.55 < lost.t - last < 2.0
        assert ch.recv() is None                # the coordinator hung up
        assert "declared lost" in said[0]
        time.sleep(0.3)
        assert events.empty()                   # the close that follows is not a second loss
    finally:
        ep.close()


def test_agent_fences_when_renewals_go_unanswered_and_not_while_answered():
    sent, fenced = [], []
    answered = threading.Event()
    answered.set()
    lease = None

    def send(msg):
        sent.append(msg)
        if answered.is_set():
            lease.renewed(make("renewed", seq=msg["seq"]))

    lease = AgentLease(0.3, send, lambda silent: fenced.append(silent))
    lease.start()
    time.sleep(0.9)
    assert not fenced and len(sent) >= 6
    answered.clear()
    cut = time.monotonic()
    assert lease.fenced.wait(2.0)
    time.sleep(0.05)
    assert len(fenced) == 1 and 0.3 <= fenced[0] < 0.6 and time.monotonic() - cut < 0.6
    lease.stop()


def test_an_agent_runs_nothing_for_a_coordinator_that_cannot_prove_the_secret():
    """A listener that challenges like the launcher but holds another secret."""
    events = queue.Queue()
    impostor = NodeEndpoint(events, SECRET, lambda w: None, welcome=lambda hello: make(
        "welcome", lease=3.0, script="evil.py", args=[], env={}, proof=welcome_proof(b"x" * 32, "n1", hello["nonce"])))
    try:
        with pytest.raises(ProtocolError, match="could not prove it holds the job secret"):
            serve(impostor.address, SECRET, "n1", [])
    finally:
        impostor.close()


def test_a_node_declared_lost_cannot_come_back_under_its_name():
    nodes = Nodes()
    hello = {"node": "hostb", "devices": ["hostb/cpu0"], "device_faults": False, "pid": 7}
    link = object()
    nodes.add(hello, link)
    nodes.lose("hostb", link)
    with pytest.raises(ProtocolError, match="was declared lost"):
        nodes.add(hello, object())
    nodes.add({**hello, "node": "hostb2"}, object())       # as a new node it may


def test_remote_options_are_checked():
    ok = RunConfig(script="t.py", launch=LaunchConfig(secret_file="s"),
                   hosts=HostsConfig(listen="10.0.0.1:29400", remote_nodes=3))
    assert (ok.local_nodes, ok.store_addr) == (0, "10.0.0.1")
    with pytest.raises(ConfigError, match="not a wildcard"):
        HostsConfig(listen="0.0.0.0:29400")
    with pytest.raises(ConfigError, match="needs --listen"):
        HostsConfig(remote_nodes=2)
    with pytest.raises(ConfigError, match="needs --secret-file"):
        RunConfig(script="t.py", hosts=HostsConfig(listen="10.0.0.1:1", remote_nodes=1))
    assert RunConfig(script="t.py").local_nodes == 1 and RunConfig(script="t.py").store_addr == "127.0.0.1"
    assert parse_devices("cpu:2", "h") == ["h/cpu0", "h/cpu1"] and parse_devices("none", "h") == []
    with pytest.raises(ConfigError):
        parse_devices("gpu:2", "h")


def test_gloo_interface_is_the_one_that_routes_to_the_store():
    assert gloo_interface("127.0.0.1")[0] == "lo"
