"""The launcher's in-process link between its node agent and its coordinator (protocol/local.py):
in order, a relay passed as it is, everything else through the same encoding and schema checks
as a socket, and an end of stream either side sees."""
from __future__ import annotations

import threading

import pytest

from hotspare.errors import ProtocolError
from hotspare.protocol.local import local_pair
from hotspare.protocol.messages import VERSION, make


def test_messages_arrive_in_order_relays_as_they_are_the_rest_as_over_a_socket():
    agent, coord = local_pair("n0")
    relay = make("relay", worker="w1", t=12.5, msg={"v": VERSION, "type": "commit", "step": 3})
    started = make("started", worker="w1", pid=41)
    agent.send(started)
    agent.send(relay)
    agent.send_later(make("stopped", worker="w1", stopped=True), 8, 1.0)
    got = [coord.recv() for _ in range(3)]
    assert [m["type"] for m in got] == ["started", "relay", "stopped"]
    assert got[1] is relay and got[0] == started and got[0] is not started      # encoded, decoded
    coord.send(make("spawn", worker="w2", role="spare", rank=None, device=("n0/cpu1")))
    assert agent.recv()["worker"] == "w2"


def test_a_message_the_schema_refuses_is_refused_at_the_receiving_end():
    agent, coord = local_pair("n0")
    bad = make("started", worker="w1", pid=41)
    bad["pid"] = "forty-one"
    agent.send(bad)
    with pytest.raises(ProtocolError):
        coord.recv()
    agent.send(make("exited", worker="w1", code=-9))     # the link goes on
    assert coord.recv()["code"] == -9


def test_a_closed_end_is_the_end_of_stream_on_both_sides():
    agent, coord = local_pair("n0")
    woke = []
    reader = threading.Thread(target=lambda: woke.append(agent.recv()))
    reader.start()
    agent.close()                      # its own blocked reader wakes to the end, as with a socket
    reader.join(5)
    assert woke == [None] and coord.recv() is None and coord.recv() is None
    with pytest.raises(OSError):
        agent.send(make("exited", worker="w1", code=0))
    coord.close()
    with pytest.raises(OSError):
        coord.send(make("shutdown", grace=1.0))
