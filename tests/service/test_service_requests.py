"""The coordinator service's one address, as clients and strangers meet it: submit, status and
cancel with the secret; a bad job refused with its reason; an unauthenticated connection or a
client of another secret refused and logged, the service unharmed. No workers run here."""
import argparse
import os
import socket
import sys

import pytest

from hotspare.cli.jobs import request
from hotspare.protocol import auth
from hotspare.protocol.channel import Channel
from hotspare.service.service import Service
from hotspare.testing.local import EXAMPLE


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def service(tmp_path, secret_file):
    lines = []
    svc = Service("127.0.0.1", 0, auth.load_secret(secret_file), secret_file, str(tmp_path / "state"),
                  log=lines.append)
    svc.lines = lines
    yield svc
    svc.stop()


def cli(service, secret_file):
    return argparse.Namespace(coordinator=service.address, secret_file=secret_file)


def job(**over):
    return {"script": str(EXAMPLE), "args": ["--steps", "3"], "nodes": 1, "nproc_per_node": 2, "spares": 1,
            "run_args": [], **over}


def test_submit_status_cancel(service, secret_file):
    c = cli(service, secret_file)
    reply = request(c, "submit", **job())
    assert reply["job"] == "j1"
    status = request(c, "status")
    assert [(j["id"], j["state"]) for j in status["jobs"]] == [("j1", "queued")]   # no hosts yet
    assert request(c, "cancel", job="j1")["ok"]
    assert request(c, "status", job="j1")["jobs"][0]["state"] == "cancelled"
    with pytest.raises(LookupError, match="has cancelled"):
        request(c, "cancel", job="j1")


@pytest.mark.parametrize("bad, why", [
    (job(run_args=["--hang-floor", "-1"]), "--hang-floor"),
    (job(script="/no/such/train.py"), "not found"),
    (job(nodes=0), "1..4096"),
    (job(run_args=["--no-such-flag"]), "unrecognized"),
])
def test_a_bad_job_is_refused_with_its_reason_and_nothing_is_queued(service, secret_file, bad, why):
    c = cli(service, secret_file)
    with pytest.raises(LookupError, match=why):
        request(c, "submit", **bad)
    assert request(c, "status")["jobs"] == []
    assert any("CLIENT  refused 'submit'" in line for line in service.lines)


def test_strangers_are_refused_and_the_service_goes_on(service, secret_file, tmp_path, capfd):
    other = tmp_path / "other"
    other.write_text(os.urandom(32).hex())
    other.chmod(0o600)
    with pytest.raises(LookupError, match="refused"):
        request(argparse.Namespace(coordinator=service.address, secret_file=str(other)), "status")
    host, port = service.address.rsplit(":", 1)
    for junk in (b"\x00\xff garbage\n", b'{"v": 1, "type": "status"}\n', b"x" * 70000 + b"\n"):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(junk)
            s.settimeout(5)
            try:
                while s.recv(65536):
                    pass
            except OSError:
                pass
    # a client may not pose as a node agent with its token, nor a node as a client
    token = auth.client_token(auth.load_secret(secret_file))
    with pytest.raises((OSError, Exception)):
        ch = auth.connect(service.address, auth.NODE, token, node="evil", pid=1, devices=[], device_faults=False)
        assert ch.recv()["type"] == "refused"
        raise OSError("refused as it should be")
    assert request(cli(service, secret_file), "status")["ok"]
    logged = capfd.readouterr().err
    assert "failed authentication (wrong or missing job secret)" in logged
    assert logged.count("refused a connection from 127.0.0.1") >= 4, logged
