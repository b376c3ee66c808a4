"""A worker's held commit reports (runtime/link.py ``AgentLink.send_later`` over
protocol/channel.py ``Channel.send_later``): held unchecked and unencoded, checked and encoded
together when they go, and never out of order with what is sent at once, from any thread."""
import io
import threading
import time

import pytest

from hotspare.errors import ConfigError, ProtocolError
from hotspare.protocol.channel import Channel
from hotspare.protocol.messages import decode
from hotspare.runtime.link import AgentLink


class _Wire:
    """A socket that records what would have crossed it, each ``sendall``'s bytes apart."""

    def __init__(self):
        self.calls: list[bytes] = []

    def setsockopt(self, *args):
        pass

    def makefile(self, mode):
        return io.BytesIO()

    def sendall(self, data):
        self.calls.append(data)

    def messages(self):
        return [decode(line, 1 << 20) for call in self.calls for line in call.splitlines(keepends=True)]


def _link():
    link = AgentLink("unused:0", "w1", "worker", where=lambda: None)
    wire = _Wire()
    link._channel = Channel(wire)
    return link, wire


def commit(link, step, held=4, held_s=60.0):
    link.send_later(held, held_s, "commit", gen=1, rank=1, step=step, dt=0.1)


def test_held_reports_go_out_together_at_the_count_in_one_write():
    link, wire = _link()
    for step in range(3):
        commit(link, step)
    assert wire.calls == []                       # held: nothing made or sent yet
    commit(link, 3)
    assert len(wire.calls) == 1 and [m["step"] for m in wire.messages()] == [0, 1, 2, 3]


def test_a_message_sent_at_once_takes_the_held_ones_first_in_order():
    link, wire = _link()
    commit(link, 0)
    commit(link, 1)
    link.send("reducing", gen=1, rank=1, step=2)
    assert len(wire.calls) == 1
    assert [(m["type"], m["step"]) for m in wire.messages()] == [("commit", 0), ("commit", 1), ("reducing", 2)]
    link.send("reducing", gen=1, rank=1, step=3)  # nothing held: on its own
    assert len(wire.calls) == 2


def test_the_oldest_held_report_waits_at_most_held_s():
    link, wire = _link()
    commit(link, 0, held=100, held_s=0.05)
    time.sleep(0.08)
    commit(link, 1, held=100, held_s=0.05)        # the oldest is too old: both go
    assert [m["step"] for m in wire.messages()] == [0, 1]


def test_reports_and_immediate_messages_from_two_threads_keep_each_ones_order():
    link, wire = _link()
    probes = threading.Thread(target=lambda: [link.send("reducing", gen=1, rank=1, step=s) for s in range(200)])
    probes.start()
    for step in range(200):
        commit(link, step, held=8)
    probes.join()
    link.send("reducing", gen=1, rank=1, step=-1)    # flushes the rest
    got = wire.messages()
    assert [m["step"] for m in got if m["type"] == "commit"] == list(range(200))
    assert [m["step"] for m in got if m["type"] == "reducing"] == [*range(200), -1]


def test_a_report_that_breaks_the_schema_still_fails_when_made():
    link, wire = _link()
    with pytest.raises(ProtocolError, match="dt"):   # not a finite number: refused where made (at the count)
        link.send_later(1, 60.0, "commit", gen=1, rank=1, step=0, dt=float("nan"))
    assert wire.calls == []                          # never sent


def test_job_log_refuses_what_a_report_could_not_carry():
    from hotspare.runtime.steps import StepProtocol
    protocol = StepProtocol.__new__(StepProtocol)
    protocol.metrics = {}
    with pytest.raises(ConfigError, match="longer than"):
        protocol.log({"x" * 300: 1.0})
    protocol.metrics = {}
    protocol.log({"loss": float("nan"), "lr": 3e-4})
    assert protocol.metrics == {"loss": "nan", "lr": 3e-4}

