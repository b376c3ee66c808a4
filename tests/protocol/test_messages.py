import json

import pytest

from hotspare.testing.faults.grammar import parse
from hotspare.errors import ConfigError, ProtocolError
from hotspare.protocol.messages import decode, encode, make


def test_roundtrip_and_validation():
    msg = make("commit", gen=2, rank=1, step=7, dt=0.5, metrics={"loss": 1.0})
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize("raw, match", [
    (b"not json\n", "not valid JSON"),
    (json.dumps([1, 2]).encode(), "JSON object"),
    (json.dumps({"v": 99, "type": "step"}).encode(), "version"),
    (json.dumps({"v": 1, "type": "shutdown_everything"}).encode(), "unknown message type"),
    (json.dumps({"v": 1, "type": "step", "gen": 1, "rank": 0}).encode(), "lacks field 'step'"),
    (json.dumps({"v": 1, "type": "step", "gen": 1, "rank": "0", "step": 1}).encode(), "must be int"),
    (json.dumps({"v": 1, "type": "step", "gen": True, "rank": 0, "step": 1}).encode(), "must be int"),
])
def test_bad_messages_are_refused_with_a_reason(raw, match):
    with pytest.raises(ProtocolError, match=match):
        decode(raw)


def test_only_a_challenge_or_a_refusal_of_another_version_is_read_with_any_version():
    other = {"v": 2, "type": "refused", "command": "connect", "message": "why"}
    assert decode(json.dumps(other).encode(), any_version=True) == other
    with pytest.raises(ProtocolError, match=r"protocol version 2 is not supported \(this is v1\)"):
        decode(json.dumps(other).encode())
    with pytest.raises(ProtocolError, match="protocol version 2 is not supported"):
        decode(json.dumps({"v": 2, "type": "welcome", "lease": 1.0, "script": "s", "args": [], "env": {},
                           "proof": "p"}).encode(), any_version=True)


def test_inject_grammar():
    f = parse("kill:rank=2:step=60", world_size=4)
    assert (f.kind, f.rank, f.step) == ("kill", 2, 60) and str(f) == "kill:rank=2:step=60"
    for spec, match in [("boom:rank=1:step=1", "unknown fault kind"), ("kill:rank=1", "missing step"),
                        ("kill:rank=x:step=1", "must be an integer"), ("kill:rank=9:step=1", "does not exist"),
                        ("kill:rank=1:step=-3", ">= 0"), ("kill:rank=1:step=2:color=red", "bad field")]:
        with pytest.raises(ConfigError, match=match):
            parse(spec, world_size=4)


def test_workers_report_step_starts_only_while_a_fault_waits_to_fire():
    from hotspare.testing.faults import Injector
    inj = Injector([parse("kill:rank=1:step=3", world_size=4)])
    assert inj.pending()
    assert inj.at_step(1, 2) is None and inj.pending()
    assert inj.at_step(1, 3) is not None and not inj.pending()     # fired: the agent stops watching
    inj.add(parse("thermal:rank=0:temp=95", world_size=4, running=True))
    assert inj.pending()                                              # armed at run time: watching again
    assert decode(encode(make("watch", steps=False)))["steps"] is False


def test_held_back_messages_go_out_in_order_in_one_write():
    import socket
    import time

    from hotspare.protocol.channel import Channel
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    tx, rx = Channel(a), Channel(b)
    b.setblocking(False)

    def pending() -> bytes:
        try:
            return b.recv(1 << 16, socket.MSG_PEEK)
        except BlockingIOError:
            return b""

    for step in range(3):
        tx.send_later(make("step", gen=1, rank=1, step=step), max_held=4, max_age_s=60)
    assert pending() == b"", "held messages must wait"
    tx.send(make("joining", gen=1, rank=1))              # any send takes the held ones first
    b.setblocking(True)
    got = [rx.recv() for _ in range(4)]
    assert [m["type"] for m in got] == ["step", "step", "step", "joining"]
    assert [m["step"] for m in got[:3]] == [0, 1, 2]
    b.setblocking(False)
    for step in range(4):                                 # the 4th fills the batch: out it goes
        tx.send_later(make("step", gen=1, rank=1, step=step), max_held=4, max_age_s=60)
    time.sleep(0.05)
    assert pending().count(b"\n") == 4
    b.setblocking(True)
    assert [rx.recv()["step"] for _ in range(4)] == [0, 1, 2, 3]
    tx.send_later(make("step", gen=1, rank=1, step=7), max_held=100, max_age_s=0.05)
    time.sleep(0.1)
    tx.send_later(make("step", gen=1, rank=1, step=8), max_held=100, max_age_s=0.05)   # the oldest is too old
    assert [rx.recv()["step"] for _ in range(2)] == [7, 8]
    tx.close()
    rx.close()


def test_a_fault_for_a_running_job_must_name_one_of_its_ranks():
    assert parse("kill:rank=1", world_size=2, running=True).now
    for spec in ("kill:rank=99", "exit:rank=2:code=3", "thermal:rank=5:temp=95"):
        with pytest.raises(ConfigError, match="does not exist"):
            parse(spec, world_size=2, running=True)


@pytest.mark.parametrize("raw, match", [
    (b'{"v": 1, "type": "commit", "gen": 1, "rank": 0, "step": 1, "dt": NaN}', "not a number"),
    (b'{"v": 1, "type": "commit", "gen": 1, "rank": 0, "step": 1, "dt": 1e999}', "'dt' is not a finite number"),
    (b'{"v": 1, "type": "commit", "gen": 1, "rank": 0, "step": 1, "dt": 0.1, "metrics": "boom"}', "metrics"),
    (b'{"v": 1, "type": "commit", "gen": 1, "rank": 0, "step": 1, "dt": 0.1, "metrics": {"a": null}}', "metrics"),
    (b'{"v": 1, "type": "commit", "gen": -1, "rank": 0, "step": 1, "dt": 0.1}', "'gen' = -1 is outside"),
    (b'{"v": 1, "type": "relay", "worker": "w1", "t": 1e12, "msg": {}}', "'t' = 1000000000000.0 is outside"),
    (b'{"v": 1, "type": "step", "gen": 1, "rank": 0, "step": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b"[" * 50000, "not valid JSON"),
])
def test_numbers_must_be_finite_and_in_range_and_nested_fields_typed(raw, match):
    with pytest.raises(ProtocolError, match=match):
        decode(raw)
