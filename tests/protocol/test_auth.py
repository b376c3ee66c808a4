"""The authentication module: keys, proofs, secret files, and the handshake over a real socket."""
import json
import os
import socket
import stat
import threading

import pytest

from hotspare.errors import ConfigError
from hotspare.protocol import auth
from hotspare.protocol.channel import Channel

SECRET = b"k" * 32


def test_proofs_bind_key_role_identity_and_nonce():
    key = auth.node_key(SECRET)
    p = auth.proof(key, auth.NODE, "n0", "abc")
    assert auth.verify(key, auth.NODE, "n0", "abc", p)
    for args in [(auth.node_key(b"x" * 32), auth.NODE, "n0", "abc"), (key, auth.WORKER, "n0", "abc"),
                 (key, auth.NODE, "n1", "abc"), (key, auth.NODE, "n0", "abd")]:
        assert not auth.verify(*args, p), args
    assert not auth.verify(key, auth.NODE, "n0", "abc", "")


def test_each_worker_and_the_operator_get_a_key_of_their_own():
    keys = {auth.worker_token(SECRET, "w0"), auth.worker_token(SECRET, "w1"), auth.operator_token(SECRET),
            auth.node_key(SECRET), auth.worker_token(b"j" * 32, "w0")}
    assert len(keys) == 5
    assert auth.worker_token(SECRET, "w0") == auth.worker_token(SECRET, "w0")     # derived, not stored
    assert len(auth.new_secret()) == auth.SECRET_BYTES and auth.new_secret() != auth.new_secret()


def test_secret_files_must_be_private_and_long_enough(tmp_path):
    f = tmp_path / "secret"
    f.write_text("a" * 64 + "\n")
    f.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        auth.load_secret(f)
    f.chmod(0o600)
    assert auth.load_secret(f) == b"a" * 64
    f.write_text("short")
    with pytest.raises(ConfigError, match="at least 32"):
        auth.load_secret(f)
    with pytest.raises(ConfigError, match="cannot read"):
        auth.load_secret(tmp_path / "missing")


def test_a_huge_file_or_a_fifo_given_as_secret_file_is_refused_unread(tmp_path):
    """Read size-bounded: a 1 GiB (sparse) file is refused by its size, and a FIFO, which would
    block the reader until someone writes it, at once."""
    f = tmp_path / "secret"
    f.write_text("")
    f.chmod(0o600)
    os.truncate(f, 1 << 30)
    with pytest.raises(ConfigError, match=r"cannot read it \(.*more than the 4096 a secret file holds"):
        auth.load_secret(f)
    f.unlink()
    os.mkfifo(f, 0o600)
    with pytest.raises(ConfigError, match="not a regular file"):
        auth.load_secret(f)
    assert not auth.verify(auth.node_key(SECRET), auth.NODE, "n0", "abc", "é" * 64)   # not ASCII: wrong, no TypeError


def test_private_files_and_folders_are_the_users_only(tmp_path):
    old = os.umask(0)                         # even with a permissive umask
    try:
        d = auth.private_dir(tmp_path / "runs")
        f = d / "1.json"
        auth.write_private(f, "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and stat.S_IMODE(f.stat().st_mode) == 0o600
    assert f.read_text() == "{}" and [p.name for p in d.iterdir()] == ["1.json"]


def _handshake(key_for):
    """A listener side on a real socket: the hello it accepted, or the error it raised."""
    server = socket.create_server(("127.0.0.1", 0))
    out = {}

    def serve():
        sock, _ = server.accept()
        ch = Channel(sock, max_line=auth.HELLO_MAX_LINE)
        try:
            out["hello"] = auth.accept(ch, auth.WORKER, key_for)
        except auth.AuthError as e:
            out["error"] = str(e)
        ch.close()
    t = threading.Thread(target=serve)
    t.start()
    return f"127.0.0.1:{server.getsockname()[1]}", t, out, server


def test_the_handshake_accepts_the_right_token_and_refuses_others():
    token = auth.worker_token(SECRET, "w3")
    address, t, out, server = _handshake(lambda w: auth.worker_token(SECRET, w))
    auth.connect(address, auth.WORKER, token, worker="w3", pid=os.getpid(), role="spare").close()
    t.join(5)
    assert out["hello"]["worker"] == "w3" and out["hello"]["role"] == "spare"
    server.close()
    address, t, out, server = _handshake(lambda w: auth.worker_token(SECRET, w))
    auth.connect(address, auth.WORKER, token, worker="w1", pid=os.getpid(), role="spare").close()   # w3's token
    t.join(5)
    assert "hello" not in out and "worker 'w1' failed authentication" in out["error"]
    server.close()


def test_a_hello_of_another_protocol_version_is_refused_naming_both():
    address, t, out, server = _handshake(lambda w: auth.worker_token(SECRET, w))
    ch = Channel.connect(*address.split(":"))
    nonce = ch.recv()["nonce"]
    hello = {"v": 2, "type": "hello", "worker": "w3", "pid": os.getpid(), "role": "spare",
             "proof": auth.proof(auth.worker_token(SECRET, "w3"), auth.WORKER, "w3", nonce)}
    ch.sock.sendall(json.dumps(hello).encode() + b"\n")
    t.join(5)
    ch.close()
    server.close()
    assert "hello" not in out and out["error"].startswith("protocol version 2 is not this listener's 1")


def test_a_client_reads_the_challenge_and_refusal_of_a_listener_of_another_version():
    server = socket.create_server(("127.0.0.1", 0))
    got = {}

    def serve():                 # a listener of protocol version 2
        sock, _ = server.accept()
        lines = sock.makefile("rb")
        sock.sendall(json.dumps({"v": 2, "type": "challenge", "nonce": "n"}).encode() + b"\n")
        got["hello"] = json.loads(lines.readline())
        sock.sendall(json.dumps({"v": 2, "type": "refused", "command": "connect",
                                 "message": "protocol version 1 is not this listener's 2"}).encode() + b"\n")
        sock.close()
    t = threading.Thread(target=serve)
    t.start()
    ch = auth.connect(f"127.0.0.1:{server.getsockname()[1]}", auth.WORKER, "k", worker="w3", pid=os.getpid(),
                      role="spare")
    reply = ch.recv(any_version=True)
    t.join(5)
    ch.close()
    server.close()
    assert got["hello"]["v"] == 1 and got["hello"]["type"] == "hello"
    assert reply["message"] == "protocol version 1 is not this listener's 2"


def test_a_worker_without_its_token_is_told_what_is_wrong(monkeypatch):
    monkeypatch.delenv(auth.ENV_WORKER_TOKEN, raising=False)
    with pytest.raises(ConfigError, match="HOTSPARE_WORKER_TOKEN is not set"):
        auth.worker_connect("127.0.0.1:1", "w0", "active")
