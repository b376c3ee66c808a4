"""An attacker on the same host, against every port of a job (loopback only): each forged,
unauthenticated, out-of-role or malformed message is refused and logged, resources stay
bounded, and the job under attack ends with the fault-free digest (docs/SECURITY.md)."""
import contextlib
import json
import os
import queue
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from hotspare.agent import NodeAgent
from hotspare.coordinator import events as ev
from hotspare.coordinator.control import ControlServer, send, token_for
from hotspare.coordinator.nodes import NodeEndpoint, Nodes
from hotspare.coordinator.trust import check_claims
from hotspare.errors import ProtocolError
from hotspare.protocol import auth
from hotspare.protocol.listen import Listener
from hotspare.protocol.messages import make
from hotspare.testing import run_job
from hotspare.testing.local import EXAMPLE, REPO

SECRET = b"s" * 32
WORKER = [sys.executable, str(Path(__file__).resolve().parents[1] / "scripts" / "echo_worker.py")]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2"}
LINE = {"v": 1}


def next_event(events, types, timeout=20.0):
    """The next event of one of ``types`` (``coordinator.events``) and every other event seen before it."""
    deadline, before = time.time() + timeout, []
    while True:
        event = events.get(timeout=max(0.01, deadline - time.time()))
        if isinstance(event, tuple(types)):
            return event, before
        before.append(event)


def raw(address: str) -> tuple[socket.socket, "object"]:
    """A bare connection, as an attacker has it, with the listener's challenge already read."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    lines = sock.makefile("rb")
    assert json.loads(lines.readline())["type"] == "challenge"
    return sock, lines


def send_line(sock: socket.socket, msg: dict) -> None:
    sock.sendall(json.dumps(msg).encode() + b"\n")


@contextlib.contextmanager
def cluster():
    """A node endpoint with the coordinator's picture of the fleet, and node agents on it that
    run the echo worker (tests/scripts/echo_worker.py)."""
    events: queue.Queue = queue.Queue()
    nodes = Nodes()
    endpoint = NodeEndpoint(events, SECRET, owner=nodes.owner)
    agents = []

    def connect(name):
        agents.append(NodeAgent(WORKER, ENV, coordinator=endpoint.address, secret=SECRET, node=name,
                                devices=[f"{name}/cpu0"], spawn="exec"))
        e, _ = next_event(events, {ev.NodeConnected})
        return agents[-1], nodes.add(e.hello, e.channel)

    try:
        yield events, endpoint, nodes, connect
    finally:
        for agent in agents:
            agent.shutdown(grace=0.0)
        endpoint.close()


def marker(events, agent, text):
    """Have ``agent`` say something harmless and wait for it: everything it sent before has been
    judged by then (one link, in order). The events that came before it."""
    agent.uplink.send(make("refused", command="marker", message=text))
    while True:
        e, before = next_event(events, {ev.AgentRefused})
        if e.message == text:
            return before


# ---------------------------------------------------------------------- finding 1: nodes
def test_a_forged_node_is_refused_and_a_real_one_speaks_only_for_its_own_workers(capfd):
    with cluster() as (events, endpoint, nodes, connect):
        a, _ = connect("a")
        b, _ = connect("b")
        w = nodes.spawn("active", rank=0)
        assert nodes.workers[w].node == "a"
        e, _ = next_event(events, {ev.WorkerSaid})
        assert (e.worker, e.type) == (w, "ready")

        sock, lines = raw(endpoint.address)                  # no secret: a fake node
        send_line(sock, {**LINE, "type": "agent_hello", "node": "evil", "pid": 1, "devices": ["evil/cpu0"],
                         "device_faults": False, "proof": "00" * 32})
        reply = json.loads(lines.readline())
        assert reply["type"] == "refused" and "failed authentication" in reply["message"]
        assert lines.readline() == b""
        sock, lines = raw(endpoint.address)                  # no hello at all, straight to business
        send_line(sock, {**LINE, "type": "exited", "worker": w, "code": 1})
        assert "must begin with 'agent_hello'" in json.loads(lines.readline())["message"]

        now = time.time()
        commit = make("commit", gen=1, rank=0, step=3, dt=0.1)
        for forged in [make("relay", worker=w, t=now, msg=commit), make("exited", worker=w, code=1),
                       make("started", worker=w, pid=1), make("stopped", worker=w, stopped=True),
                       make("injected", worker=w, fault="kill:rank=0:step=1", id=0, t=now),
                       make("relay", worker="w99", t=now, msg=commit)]:
            b.uplink.send(forged)                            # node b speaks of a's worker: refused
        assert not [e for e in marker(events, b, "b done") if not isinstance(e, ev.AgentRefused)]

        bad = [{"type": "relay", "worker": w, "t": now, "msg": {**commit, "metrics": "boom"}},
               {"type": "relay", "worker": w, "t": 1e12, "msg": commit},
               {"type": "relay", "worker": w, "t": now + 3600, "msg": commit},
               {"type": "relay", "worker": w, "t": now, "msg": {**commit, "dt": 1e300}},
               {"type": "relay", "worker": w, "t": now, "msg": {**commit, "rank": 2 ** 40}},
               {"type": "relay", "worker": w, "t": now, "msg": {**commit, "metrics": {"loss": [1]}}},
               {"type": "relay", "worker": w, "t": now, "msg": make("spawn", worker="w5", role="spare",
                                                                    rank=None, device=None)},
               {"type": "relay", "worker": w, "t": now, "msg": make("ready", worker="w7", committed=0)},
               {"type": "relay", "worker": w, "t": now, "msg": {
                   **LINE, "type": "failed", "gen": 1, "rank": 0, "committed": 2, "error": "x",
                   "health": {"kind": "fingerprint", "suspects": [1, "all"], "step": 2}}}]
        for msg in bad:                                     # a's own worker, but garbage: refused
            send_line(a.uplink.sock, {**LINE, **msg})
        a.uplink.sock.sendall(b'{"v": 1, "type": "relay", "worker": "' + w.encode() + b'", "t": NaN, "msg": {}}\n')
        assert not [e for e in marker(events, a, "a done") if not isinstance(e, ev.AgentRefused)]

        a.uplink.send(make("relay", worker=w, t=time.time(), msg=make("commit", gen=1, rank=0, step=3, dt=0.1,
                                                                       metrics={"loss": 2.5, "note": "nan"})))
        e, _ = next_event(events, {ev.WorkerSaid})           # an honest one still goes through
        assert (e.worker, e.msg["metrics"]) == (w, {"loss": 2.5, "note": "nan"}) and e.t <= time.time()
        assert nodes.alive() == [w] and not nodes.nodes["a"].lost
    err = capfd.readouterr().err
    refused = err.count("hotspare: refusing") + err.count("hotspare: ignoring a bad message")
    assert refused == len(bad) + 1 + 6 and "failed authentication" in err, err


def test_a_worker_claims_only_its_own_rank_and_no_future_generation():
    check_claims(make("done", gen=2, rank=1, step=9, digest="ab"), held_rank=1, generation=2, world_size=2)
    check_claims(make("ready", worker="w3", committed=-1), held_rank=None, generation=2, world_size=2)
    for msg, held in [(make("done", gen=2, rank=0, step=9, digest="deadbeef"), 1),      # another's rank
                      (make("failed", gen=2, rank=1, committed=3, error="x"), None),    # a spare
                      (make("commit", gen=3, rank=1, step=3, dt=0.1), 1),               # not formed yet
                      (make("commit", gen=1, rank=5, step=3, dt=0.1), 5)]:              # outside the job
        with pytest.raises(ProtocolError):
            check_claims(msg, held_rank=held, generation=2, world_size=2)


# ---------------------------------------------------------------------- finding 2: worker port
def test_a_worker_id_cannot_be_taken_over_on_the_agent_port(capfd):
    with cluster() as (events, endpoint, nodes, connect):
        a, _ = connect("a")
        w = nodes.spawn("active", rank=0)
        next_event(events, {ev.WorkerSaid})                  # its ready: its channel is up
        sock, lines = raw(a.address)                          # an outsider says it is w
        send_line(sock, {**LINE, "type": "hello", "worker": w, "pid": 1, "role": "active", "proof": "ab" * 32})
        assert lines.readline() == b""
        thief = auth.connect(a.address, auth.WORKER, auth.worker_token(SECRET, w),   # even with w's token:
                             worker=w, pid=1, role="active")                          # w is connected already
        assert thief.recv() is None
        assert nodes.send(w, make("probe", gen=1))          # the real w still has its channel
        e, _ = next_event(events, {ev.WorkerSaid})
        assert (e.worker, e.type) == (w, "reducing")
    err = capfd.readouterr().err
    assert "failed authentication" in err and f"worker {w} already has a control connection" in err


# ---------------------------------------------------------------------- finding 3: control port
def test_operator_commands_need_the_token_and_are_logged_with_their_origin(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("HOTSPARE_RUN_DIR", str(tmp_path / "runs"))
    events: queue.Queue = queue.Queue()
    control = ControlServer(events, SECRET)
    try:
        assert stat.S_IMODE(control.run_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(control.run_file.parent.stat().st_mode) == 0o700
        token = json.loads(control.run_file.read_text())["token"]
        assert token == auth.operator_token(SECRET) == token_for(control.address)   # --job HOST:PORT finds it
        sock, lines = raw(control.address)                    # no token
        send_line(sock, {**LINE, "type": "inject", "spec": "kill:rank=1", "operator": "mallory", "proof": "0"})
        reply = json.loads(lines.readline())
        assert reply["ok"] is False and "failed authentication" in reply["message"]
        sock, lines = raw(control.address)                    # an old client without a proof
        send_line(sock, {**LINE, "type": "inject", "spec": "kill:rank=1"})
        assert json.loads(lines.readline())["ok"] is False
        with pytest.raises(queue.Empty):
            events.get(timeout=0.3)

        result = {}
        t = threading.Thread(target=lambda: result.update(reply=send(control.address, "kill:rank=1", token)))
        t.start()
        e = events.get(timeout=10)
        assert isinstance(e, ev.OperatorCommand) and (e.msg["type"], e.msg["spec"]) == ("inject", "kill:rank=1")
        assert e.origin.startswith("operator ") and " from 127.0.0.1:" in e.origin
        e.reply(make("control_reply", ok=True, message="armed"))
        t.join(10)
        assert result["reply"]["ok"] is True
    finally:
        control.close()
    assert "hotspare-control-server: refused a connection from 127.0.0.1:" in capfd.readouterr().err
    assert not control.run_file.exists()


# ---------------------------------------------------------------------- finding 5: resources
def _threads_named(prefix: str) -> int:
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def test_idle_trickling_and_oversized_connections_are_closed_and_threads_stay_bounded(capfd):
    server = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{server.getsockname()[1]}"
    served = []
    listener = Listener(server, lambda ch: auth.accept(ch, auth.OPERATOR, lambda op: "tok"),
                        lambda ch, hello: served.append(hello["operator"]), "slow-test",
                        max_pending=8, deadline_s=0.5, hello_max_line=1024)
    try:
        # 16 silent ones: each newcomer past 8 evicts the oldest; the last two trickle and overflow
        # (16 refusals in all: under the log's rate cap, so each is said).
        idle = [socket.create_connection(server.getsockname()) for _ in range(16)]
        time.sleep(0.2)
        assert _threads_named("slow-test-conn") <= 8 and listener.pending() <= 8
        trickle = idle[-1]
        huge = idle[-2]
        huge.sendall(b"x" * 4096)                           # no newline, past the line limit
        deadline = time.time() + 60
        closed = set()
        while len(closed) < len(idle) and time.time() < deadline:   # every one is closed in turn
            for i, s in enumerate(idle):
                if i in closed:
                    continue
                if s is trickle:
                    with contextlib.suppress(OSError):
                        s.send(b" ")
                s.settimeout(0.01)
                try:
                    while True:
                        data = s.recv(65536)
                        if not data:
                            closed.add(i)
                            break
                except (socket.timeout, BlockingIOError):
                    pass
                except OSError:
                    closed.add(i)
            assert _threads_named("slow-test-conn") <= 8
        assert len(closed) == len(idle), f"{len(idle) - len(closed)} idle connection(s) never closed"
        ch = auth.connect(address, auth.OPERATOR, "tok", spec="kill:rank=0", operator="alice")
        ch.close()
        deadline = time.time() + 10
        while not served and time.time() < deadline:
            time.sleep(0.02)
        assert served == ["alice"]                          # still serving
    finally:
        listener.close()
    err = capfd.readouterr().err
    assert "no hello within" in err and "longer than 1024 bytes" in err and "evicted unauthenticated" in err


def test_a_flood_of_refused_connections_does_not_flood_the_log(capfd):
    from hotspare.protocol.listen import LOG_BURST
    server = socket.create_server(("127.0.0.1", 0))
    listener = Listener(server, lambda ch: auth.accept(ch, auth.OPERATOR, lambda op: "tok"),
                        lambda ch, hello: None, "flood-test")
    try:
        for _ in range(3 * LOG_BURST):
            sock, lines = raw(f"127.0.0.1:{server.getsockname()[1]}")
            send_line(sock, {**LINE, "type": "probe", "gen": 1})
            assert lines.readline() == b""              # refused and closed, every one
            sock.close()
    finally:
        listener.close()
    assert capfd.readouterr().err.count("flood-test: refused a connection") == LOG_BURST


EMFILE_SCRIPT = textwrap.dedent("""
    import os, resource, socket, sys, threading, time
    from hotspare.protocol import auth, listen
    from hotspare.protocol.listen import Listener
    refused = threading.Event()           # the accept loop met EMFILE and said so
    say = listen._say
    listen._say = lambda line: (say(line), "cannot accept" in line and refused.set())
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    server = socket.create_server(("127.0.0.1", 0))
    got = []
    Listener(server, lambda ch: auth.accept(ch, auth.OPERATOR, lambda op: "tok"),
             lambda ch, hello: (got.append(hello["operator"]), ch.close()), "emfile-test")
    hog = []
    try:
        while True:
            hog.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    print(server.getsockname()[1], flush=True)
    sys.stdin.readline()                     # the client is connecting: accept hits EMFILE
    refused.wait(30)                         # (however loaded the machine, before the fds come back)
    for fd in hog:
        os.close(fd)
    deadline = time.time() + 20
    while not got and time.time() < deadline:
        time.sleep(0.05)
    print("served", got, flush=True)
""")


def test_the_accept_loop_survives_running_out_of_file_descriptors():
    proc = subprocess.Popen([sys.executable, "-c", EMFILE_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        port = int(proc.stdout.readline())
        result = {}
        t = threading.Thread(target=lambda: result.update(ch=auth.connect(
            f"127.0.0.1:{port}", auth.OPERATOR, "tok", spec="kill:rank=0", operator="bob")))
        t.start()
        time.sleep(0.3)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        t.join(30)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "served ['bob']" in out, out + err
    assert "cannot accept a connection (Too many open files); retrying" in err
    result["ch"].close()


# ---------------------------------------------------------------------- finding 4: bind addresses
def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on, from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:            # LISTEN
                hexaddr, hexport = fields[1].split(":")
                if table == "tcp":
                    addr = socket.inet_ntop(socket.AF_INET, bytes.fromhex(hexaddr)[::-1])
                else:
                    words = bytes.fromhex(hexaddr)
                    addr = socket.inet_ntop(socket.AF_INET6, b"".join(words[i:i + 4][::-1] for i in range(0, 16, 4)))
                out.append((addr, int(hexport, 16)))
    return out


def test_the_rendezvous_store_listens_only_on_its_address():
    from hotspare.pg.bound_store import master_store
    store = master_store("127.0.0.1")
    mine = [a for a in listening(os.getpid()) if a[1] == store.port]
    assert mine == [("127.0.0.1", store.port)], mine
    store.set("k", "v")
    assert store.get("k") == b"v"


# ---------------------------------------------------------------------- a job under attack
JOB = ["--model", "tiny", "--steps", "1500"]


@pytest.fixture(scope="module")
def reference():
    result = run_job(JOB, nproc=2, spares=1)
    assert result.code == 0, result.output
    return result.digest


def start(tmp_path, *extra):
    """A running job (2 ranks, 1 spare), once its first generation started; its environment."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOTSPARE_RUN_DIR": str(tmp_path / "runs")}
    proc = subprocess.Popen([sys.executable, "-m", "hotspare", "run", "--nproc", "2", "--spares", "1", *extra,
                             "--report", str(tmp_path / "report.json"), "--", str(EXAMPLE), *JOB],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "START" in line:
            return proc, lines, env
    proc.kill()
    raise AssertionError("".join(lines))


def finish(proc, lines, tmp_path) -> tuple[dict, str]:
    lines += proc.stdout.readlines()
    assert proc.wait(timeout=300) == 0, "".join(lines)
    return json.loads((tmp_path / "report.json").read_text()), "".join(lines)


@pytest.mark.slow   # run by .ci/run after the default suite (the default suite's budget: README)
def test_a_job_under_attack_on_every_port_ends_with_the_fault_free_digest(tmp_path, reference):
    proc, lines, env = start(tmp_path, "--allow-inject")
    try:
        ports = listening(proc.pid)
        # the node agent's worker port, the control port, the store (the agent and the coordinator
        # share the launcher's process and a link in it: no node endpoint to attack)
        assert len(ports) == 3 and {a for a, _ in ports} == {"127.0.0.1"}, ports
        (run_file,) = (tmp_path / "runs").glob("*.json")
        assert stat.S_IMODE(run_file.stat().st_mode) == 0o600
        control = json.loads(run_file.read_text())["control"]
        now = time.time()
        forged = [{"type": "agent_hello", "node": "evil", "pid": 1, "devices": [], "device_faults": False,
                   "proof": "00"},
                  {"type": "hello", "worker": "w1", "pid": 1, "role": "active", "proof": "00"},
                  {"type": "inject", "spec": "kill:rank=1", "operator": "mallory", "proof": "00"},
                  {"type": "relay", "worker": "w1", "t": now,
                   "msg": {**make("commit", gen=1, rank=1, step=3, dt=0.1), "metrics": "boom"}},
                  {"type": "relay", "worker": "w1", "t": now, "msg": make("done", gen=1, rank=1, step=5,
                                                                           digest="deadbeef")},
                  {"type": "exited", "worker": "w1", "code": 1}]
        ours = []
        for _, port in ports:                     # ours challenge at once; torch's store says nothing
            with socket.create_connection(("127.0.0.1", port), timeout=5) as probe:
                probe.settimeout(2)
                with contextlib.suppress(OSError):
                    if b'"challenge"' in probe.recv(4096):
                        ours.append(port)
        assert len(ours) == 2 and control.endswith(tuple(f":{p}" for p in ours)), (ours, control)
        for port in ours:
            for msg in forged:
                sock, replies = raw(f"127.0.0.1:{port}")
                send_line(sock, {**LINE, **msg})
                with contextlib.suppress(OSError):
                    replies.readline()
                sock.close()
        out_of_job = subprocess.run([sys.executable, "-m", "hotspare", "inject", "kill:rank=99"],
                                    capture_output=True, text=True, env=env)
        assert out_of_job.returncode == 1 and "rank 99 does not exist" in out_of_job.stderr, out_of_job.stderr
        r, out = finish(proc, lines, tmp_path)
    finally:
        proc.kill()
    assert r["final_state_digest"] == reference and r["failures_total"] == 0, out
    assert "refusing a message from worker" not in out and "ignoring bad message" not in out, out
    assert out.count("refused a connection from 127.0.0.1:") >= 2 * len(forged), out
    assert "OPERATOR refused inject 'kill:rank=99' from operator" in out


def test_nothing_on_the_network_path_unpickles():
    """Control messages are JSON, state travels as raw tensors: no pickle, marshal or eval in the
    modules that read from a socket."""
    import re
    for folder in ("protocol", "coordinator", "agent", "transfer", "pg"):
        for path in (REPO / "hotspare" / folder).glob("*.py"):
            code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
            assert not re.search(r"\b(import pickle|from pickle|pickle\.loads?|marshal\.loads?|torch\.load|eval\()",
                                 code), path


@pytest.mark.slow   # run by .ci/run after the default suite (the default suite's budget: README)
def test_a_job_whose_launcher_ran_out_of_file_descriptors_still_fails_over(tmp_path, reference):
    """Connections until the launcher hits its file limit (EMFILE in every accept loop); once
    they are gone, `hotspare inject` reaches the job again and the new spare registers."""
    import resource
    proc, lines, env = start(tmp_path, "--allow-inject")
    try:
        ports = [p for _, p in listening(proc.pid)]
        used = len(os.listdir(f"/proc/{proc.pid}/fd"))
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (used + 40, used + 40))
        flood, end = [], time.monotonic() + 5.0
        for port in ports * 40:              # a full backlog makes a connect wait: keep each short,
            if time.monotonic() > end:       # and the whole flood well inside the job's run
                break
            with contextlib.suppress(OSError):
                flood.append(socket.create_connection(("127.0.0.1", port), timeout=0.2))
        time.sleep(1.0)                                  # the accept loops meet EMFILE meanwhile
        for sock in flood:
            sock.close()
        assert proc.poll() is None, "the job ended before the flood was over: make it longer"
        armed = subprocess.run([sys.executable, "-m", "hotspare", "inject", "kill:rank=1"],
                               capture_output=True, text=True, env=env, timeout=60)
        if armed.returncode != 0:                     # the launcher's whole story, once it is over
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
            proc.kill()
            lines += proc.stdout.readlines()
        assert armed.returncode == 0, (armed.stdout + armed.stderr + f"\njob exit {proc.poll()}, run files "
                                       f"{[f.name for f in (tmp_path / 'runs').glob('*')]}:\n" + "".join(lines))
        r, out = finish(proc, lines, tmp_path)
    finally:
        proc.kill()
    assert "cannot accept a connection (Too many open files)" in out
    assert r["final_state_digest"] == reference and r["failures_total"] == 1, out
    assert r["recovered_zero_loss"] == 1 and "OPERATOR inject kill:rank=1" in out
    assert "refusing a message from worker" not in out, out          # honest traffic is never refused


def test_a_secret_file_others_can_read_is_refused_before_anything_starts(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("x" * 64)
    secret.chmod(0o644)
    run = subprocess.run([sys.executable, "-m", "hotspare", "run", "--secret-file", str(secret), "--",
                          str(EXAMPLE)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and f"chmod 600 {secret}" in run.stderr, run.stderr
    inject = subprocess.run([sys.executable, "-m", "hotspare", "inject", "--job", "127.0.0.1:1", "--secret-file",
                             str(secret), "kill:rank=0"], capture_output=True, text=True, timeout=120)
    assert inject.returncode == 2 and "chmod 600" in inject.stderr, inject.stderr


def test_the_longest_line_a_worker_may_send_still_fits_in_its_relay():
    """A worker line of nearly MAX_LINE (a long traceback) reaches the coordinator: the node
    endpoint's limit leaves room for the relay around it."""
    from hotspare.protocol.messages import MAX_LINE, encode
    with cluster() as (events, endpoint, nodes, connect):
        a, _ = connect("a")
        w = nodes.spawn("active", rank=0)
        next_event(events, {ev.WorkerSaid})
        crash = make("crash", gen=0, rank=0, step=1, error="x", traceback="t" * (MAX_LINE - 200))
        assert len(encode(crash)) < MAX_LINE
        a.uplink.send(make("relay", worker=w, t=time.time(), msg=crash))
        e, _ = next_event(events, {ev.WorkerSaid})
        assert (e.worker, e.type, len(e.msg["traceback"])) == (w, "crash", MAX_LINE - 200)
