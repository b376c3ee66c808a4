"""The coordinator service's one address, as clients and strangers meet it: submit, status and
cancel with the secret; a bad job refused with its reason; an unauthenticated connection or a
client of another secret refused and logged, the service unharmed. No workers run here."""
import argparse
import os
import socket

import pytest

from hotspare.cli.jobs import request
from hotspare.protocol import auth
from hotspare.service.service import Service
from hotspare.testing.local import EXAMPLE


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
    (job(script="train.py"), "absolute path"),
    (job(nodes=0), "1..4096"),
    (job(run_args=["--no-such-flag"]), "unrecognized"),
    # a client that skips `hotspare submit`'s own check meets the service's
    (job(run_args=["--listen", "10.0.0.9:1"]), "--listen: the service's --listen address is the job's"),
    (job(run_args=["--master-port", "1234"]), "--master-port"),
    (job(run_args=["--health-db", "/tmp/x.json"]), "--health-db"),
    (job(run_args=["--inject", "kill:rank=0:step=1"]), "--inject: .*coordinator --allow-inject"),
    (job(run_args=["--allow-inject"]), "--allow-inject: .*coordinator --allow-inject"),
    # what runs is what was submitted: no other script through run_args
    (job(run_args=["--", "/tmp/other.py"]), "hold '--'"),
    (job(run_args=["--log-every", "5", "/tmp/other.py"]), "would change what runs"),
    # the flags the service owns, in either spelling, never abbreviated
    (job(run_args=["--listen=10.0.0.9:1"]), "--listen: "),
    (job(run_args=["--list", "10.0.0.9:1"]), "unrecognized --list"),
    (job(run_args=["--nproc", "8"]), "--nproc: give the ranks per host as submit's --nproc-per-node"),
    (job(run_args=["--nproc-per-node", "8"]), "--nproc-per-node: "),
    (job(run_args=["--spares", "3"]), "--spares: give the spares as submit's --spares"),
    (job(run_args=["--remote-nodes", "3"]), "--remote-nodes: give the hosts as submit's --nodes"),
    (job(run_args=["--secret-file", "/tmp/s"]), "--secret-file: the service's secret"),
    (job(run_args=["--checkpoint-key", "/tmp/k"]), "--checkpoint-key: the service's checkpoint key"),
    (job(run_args=["--report", "/tmp/r.json"]), "--report: "),
    (job(run_args=["--spawn", "exec"]), "--spawn: "),
    (job(run_args=["--node-lease", "9"]), "--node-lease: "),
])
def test_a_bad_job_is_refused_with_its_reason_and_nothing_is_queued(service, secret_file, bad, why):
    c = cli(service, secret_file)
    with pytest.raises(LookupError, match=why):
        request(c, "submit", **bad)
    assert request(c, "status")["jobs"] == []
    assert any("CLIENT  refused 'submit'" in line for line in service.lines)


def test_a_running_jobs_commands_go_through_the_service_and_only_to_a_running_job(
        tmp_path, secret_file):
    lines = []
    svc = Service("127.0.0.1", 0, auth.load_secret(secret_file), secret_file, str(tmp_path / "state"),
                  log=lines.append, allow_inject=True)
    try:
        c = cli(svc, secret_file)
        reply = request(c, "submit", **job(run_args=["--allow-inject"]))      # this service allows it
        with pytest.raises(LookupError, match="job j1 is not running \\(queued\\)"):
            request(c, "inject", job="j1", spec="kill:rank=0")
        with pytest.raises(LookupError, match="no job 'j9'"):
            request(c, "inject", job="j9", spec="kill:rank=0")
        assert reply["job"] == "j1"
    finally:
        svc.stop()


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


def test_placement_gives_a_job_only_devices_in_service_and_status_says_which_are_out(service, secret_file):
    from hotspare.service.placement import Host, place
    reg = service.registry                       # the service's database holds device health
    assert reg.path == service.db.path
    reg.ensure("hostb/cpu0")
    reg.cordon("hostb/cpu0", "temp 92 C", actor="rule:temp-limit")
    hostb = service.in_service(Host("hostb", ("hostb/cpu0", "hostb/cpu1"), False))
    assert hostb.devices == ("hostb/cpu1",)
    assert place([hostb], 1, 2, 0) is None and place([hostb], 1, 1, 0) == (["hostb"], [])
    service.db.host("hostb", ["hostb/cpu0", "hostb/cpu1"], False, "idle")
    (row,) = request(cli(service, secret_file), "status")["hosts"]
    assert row["out_of_service"] == {"hostb/cpu0": "cordoned"}


def test_the_client_refuses_a_flag_the_service_owns_before_sending(secret_file, tmp_path):
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "hotspare", "submit", "--coordinator", "127.0.0.1:9",
                           "--secret-file", secret_file, "--spawn", "exec", "--", str(EXAMPLE)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--spawn: each host's agent decides" in done.stderr, done.stderr


def test_submit_makes_nothing_on_the_services_host_and_tells_nothing_of_its_paths(service, secret_file, tmp_path):
    """Checks on the service's host were a probe: they made --checkpoint-dir there and said
    whether a path existed. Paths are met where the job runs; the files the service must read
    for a job are refused alike, whatever is wrong with them."""
    c = cli(service, secret_file)
    made = tmp_path / "not" / "made"
    assert request(c, "submit", **job(run_args=["--checkpoint-dir", str(made)]))["ok"]
    assert request(c, "submit", **job(script=str(tmp_path / "no-such.py")))["ok"]   # found missing where it runs
    assert not made.exists() and not made.parent.exists()
    answers = set()
    for path in ("/no/such/dir", "/etc", str(tmp_path)):
        with pytest.raises(LookupError) as e:
            request(c, "submit", **job(run_args=["--resume", path]))
        answers.add(str(e.value).replace(path, "PATH"))
    assert len(answers) == 1 and "no checkpoint of this service's jobs" in answers.pop()
    answers = set()
    for path in ("/no/such/rules.toml", "/etc/passwd", "/etc", "/dev/zero"):
        with pytest.raises(LookupError) as e:
            request(c, "submit", **job(run_args=["--health-rules", path]))
        answers.add(str(e.value).replace(path, "PATH"))
    assert len(answers) == 1 and "not a rules file the service can use" in answers.pop()
