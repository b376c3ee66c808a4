"""A local user floods a listener with connections that never prove themselves (loopback only):
the operator's authenticated `hotspare inject` still gets through, a flood from one address
cannot evict another address's connections, and a proof that is not ASCII is one more refused
peer, logged with its address (docs/SECURITY.md, "Bounded resources")."""
import json
import queue
import socket
import subprocess
import sys
import textwrap
import threading
import time

from hotspare.coordinator import events as ev
from hotspare.coordinator.control import ControlServer, send
from hotspare.protocol import auth
from hotspare.protocol.listen import Listener, evict_choice
from hotspare.protocol.messages import make

SECRET = b"f" * 32

# Connects as fast as its threads can, never says a word, holds up to HOLD connections open
# (oldest closed first); bounded in time and count.
FLOOD = textwrap.dedent("""
    import collections, socket, sys, threading, time
    port, seconds, hold, most = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    end, made, lock = time.monotonic() + seconds, [0], threading.Lock()
    def flood():
        held = collections.deque()
        while time.monotonic() < end and made[0] < most:
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            except OSError:
                continue
            with lock:
                made[0] += 1
            if len(held) > hold:
                held.popleft().close()
        for s in held:
            s.close()
    threads = [threading.Thread(target=flood) for _ in range(8)]
    print("flooding", flush=True)
    for t in threads: t.start()
    for t in threads: t.join()
    print(made[0], flush=True)
""")


def test_evict_choice_takes_the_oldest_of_the_busiest_address():
    pending = [("a1", "10.0.0.1"), ("b1", "10.0.0.2"), ("b2", "10.0.0.2"), ("a2", "10.0.0.1"), ("b3", "10.0.0.2")]
    assert evict_choice(pending) == "b1"
    assert evict_choice(pending[:4]) == "a1"          # a tie: the oldest of all
    assert evict_choice([("x", "h")]) == "x"


def test_an_operator_inject_gets_through_a_flood_of_unauthenticated_connections(tmp_path, monkeypatch, capfd):
    """The case of issue 29: a local user keeps every pending slot of the launcher's control
    port busy; five `hotspare inject`s in a row each get their answer at once (they waited in
    the kernel's backlog behind the flood before: 7.1 s for the five, or a failure)."""
    monkeypatch.setenv("HOTSPARE_RUN_DIR", str(tmp_path / "runs"))
    events: queue.Queue = queue.Queue()
    control = ControlServer(events, SECRET)
    answered, stop = [], threading.Event()

    def coordinator():                    # answers every operator command, as the launcher does
        while not stop.is_set():
            try:
                e = events.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(e, ev.OperatorCommand):
                answered.append(e.msg["spec"])
                e.reply(make("control_reply", ok=True, message="armed"))

    threading.Thread(target=coordinator, daemon=True).start()
    port = int(control.address.rsplit(":", 1)[1])
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, str(port), "8", "300", "20000"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert flood.stdout.readline().strip() == "flooding"
        time.sleep(1.0)                   # every pending slot is taken by now
        token = auth.operator_token(SECRET)
        t0 = time.monotonic()
        replies = [send(control.address, f"kill:rank={i}", token) for i in range(5)]
        took = time.monotonic() - t0
        still_flooding = flood.poll() is None
        made = int(flood.communicate(timeout=30)[0].split()[-1])
    finally:
        flood.kill()
        stop.set()
        control.close()
    assert [r["ok"] for r in replies] == [True] * 5, replies
    assert took < 3.0, f"five injects took {took:.1f} s under the flood"   # 0.0-0.5 s; 7.1 s before
    assert still_flooding, "the flood ended before the injects did: make it longer"
    assert answered == [f"kill:rank={i}" for i in range(5)]
    assert made > control._listener.max_pending      # the flood did fill every slot, and more
    err = capfd.readouterr().err
    assert "hotspare-control-server: refused a connection from 127.0.0.1:" in err
    assert "evicted unauthenticated" in err


def _idle(port: int, source: str) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def test_a_flood_from_one_address_does_not_evict_another_addresses_connection():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    listener = Listener(server, lambda ch: auth.accept(ch, auth.OPERATOR, lambda op: "tok"),
                        lambda ch, hello: None, "source-test", max_pending=8, deadline_s=10.0)
    try:
        other = _idle(port, "127.0.0.2")              # another host, as far as the listener sees
        other.makefile("rb").readline()               # its challenge: it is pending
        flood = [_idle(port, "127.0.0.1") for _ in range(40)]
        deadline = time.time() + 10
        while listener.evicted < 40 - 7 and time.time() < deadline:
            time.sleep(0.02)
        assert listener.evicted == 40 - 7 and listener.pending() == 8
        other.settimeout(0.2)
        try:
            assert other.recv(1) != b"", "unexpected data"
        except socket.timeout:
            pass                                      # still open: the flood evicted its own
        for s in flood + [other]:
            s.close()
    finally:
        listener.close()


def test_a_proof_that_is_not_ascii_is_refused_and_logged_with_its_peer(capfd):
    """hmac.compare_digest of two strings raises TypeError on non-ASCII: that was a traceback in
    the listener's thread, with no peer address and past the log's rate cap."""
    server = socket.create_server(("127.0.0.1", 0))
    served = []
    listener = Listener(server, lambda ch: auth.accept(ch, auth.OPERATOR, lambda op: "tok"),
                        lambda ch, hello: served.append(hello), "ascii-test")
    try:
        sock = socket.create_connection(server.getsockname(), timeout=10)
        lines = sock.makefile("rb")
        assert json.loads(lines.readline())["type"] == "challenge"
        sock.sendall(json.dumps({"v": 1, "type": "inject", "spec": "kill:rank=0", "operator": "mallory",
                                 "proof": "é" * 64}, ensure_ascii=False).encode() + b"\n")
        assert lines.readline() == b""                # refused and closed
        where = sock.getsockname()
        sock.close()
        ch = auth.connect(f"127.0.0.1:{server.getsockname()[1]}", auth.OPERATOR, "tok",
                          spec="kill:rank=0", operator="alice")
        deadline = time.time() + 10
        while not served and time.time() < deadline:
            time.sleep(0.02)
        ch.close()
    finally:
        listener.close()
    err = capfd.readouterr().err
    assert [h["operator"] for h in served] == ["alice"]          # still serving
    assert f"ascii-test: refused a connection from {where[0]}:{where[1]}: operator 'mallory' failed " \
           "authentication" in err, err
    assert "Traceback" not in err and "TypeError" not in err
