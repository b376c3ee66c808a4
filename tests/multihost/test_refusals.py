"""Strangers against a running multi-host job (2 worker hosts, 1 spare host, the launcher in the
hub): clients without the secret on the launcher's node endpoint, an agent of another protocol
version, a connection to a worker port from another host. Each is refused and logged where it
knocked, nothing crashes, and the job ends bitwise equal to a one-host run with no failure.

About 60 s on 2 cores: marked slow (CI runs -m slow)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hotspare.testing import run_job
from hotspare.testing.hostjob import HostJob

pytestmark = pytest.mark.slow
STEPS = 600
ARGS = ["--model", "tiny", "--steps", str(STEPS)]
INTRUDERS = str(Path(__file__).with_name("intruders.py"))
# `hotspare agent` speaking protocol version 2 (test-side: the module's VERSION patched before main)
AGENT_V2 = ("import sys, hotspare.protocol.messages as m; m.VERSION = 2; "
            "from hotspare.cli.main import main; sys.exit(main(sys.argv[1:]))")
REFUSED = "hotspare-node-endpoint: refused a connection from {peer}: {why}"


@pytest.fixture(scope="module")
def reference():
    """The same job on one host, over loopback, without faults."""
    result = run_job(ARGS, nproc=4, spares=2)
    assert result.code == 0, result.output
    return result.digest


def intrude(job: HostJob, host: str, address: str, cases: list[str]) -> dict[str, dict]:
    """Run intruders.py in ``host``'s namespace against ``address``: case -> what it saw."""
    done = subprocess.run(job.net.argv(job.net[host].ns, [sys.executable, INTRUDERS, address, *cases], job.env),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return {r["case"]: r for r in map(json.loads, done.stdout.splitlines())}


def worker_port(pid: int) -> int:
    """The loopback port agent ``pid`` listens on for its workers: its own listening socket,
    from its namespace's /proc/PID/net/tcp."""
    links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    inodes = {link[len("socket:["):-1] for link in links if link.startswith("socket:[")}
    ports = []
    for row in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        cols = row.split()
        local, state, inode = cols[1], cols[3], cols[9]
        if state == "0A" and inode in inodes and local.startswith("0100007F:"):     # LISTEN on 127.0.0.1
            ports.append(int(local.split(":")[1], 16))
    assert len(ports) == 1, ports
    return ports[0]


def test_strangers_are_refused_and_logged_and_the_job_is_unharmed(net, secret_file, reference, tmp_path):
    job = HostJob(net, secret_file, str(tmp_path / "r.json"), ARGS,
                  extra=["--node-lease", "2", "--lease-margin", "1", "--log-every", "10"])
    try:
        job.log.wait_for(r"step\s+20/", 120)
        # (b) an agent of protocol version 2, from hosta, with the right secret: started first, it
        # imports while the intruders knock
        other = subprocess.Popen(
            net.argv(net["hosta"].ns, [sys.executable, "-c", AGENT_V2, "agent", "--coordinator", job.address,
                                       "--secret-file", secret_file, "--devices", "cpu:1", "--name", "hostv2"],
                     job.env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # (a) clients without the secret, from hosta, against the launcher's node endpoint
        seen = intrude(job, "hosta", job.address, ["garbage", "wrong_proof", "silent", "oversized", "not_hello"])
        out, _ = other.communicate(timeout=60)
        # (c) hostb's worker port: from hosta it is not there at all; on hostb, no token, no entry
        port = worker_port(job.agents["hostb"].pid)
        from_a = intrude(job, "hosta", f"{net['hostb'].addr}:{port}", ["worker_hello"])["worker_hello"]
        on_b = intrude(job, "hostb", f"127.0.0.1:{port}", ["worker_hello"])["worker_hello"]
        assert job.launcher.poll() is None, "the job ended before the strangers were done: raise STEPS"
        code, report = job.finish()
    finally:
        job.stop()
    log = job.log.text()
    peer = f"{net['hosta'].addr}:{{}}"
    for case, why in [("garbage", "control message is not valid JSON"),
                      ("wrong_proof", "node 'intruder' failed authentication (wrong or missing job secret)"),
                      ("silent", "no hello within 5 s"),
                      ("oversized", "control message longer than 16384 bytes, or truncated"),
                      ("not_hello", "a node connection must begin with 'agent_hello', got 'exited'")]:
        s = seen[case]
        assert s["got"][0]["type"] == "challenge", s
        assert REFUSED.format(peer=peer.format(s["port"]), why=why) in log, (case, log)
        if case in ("garbage", "wrong_proof", "not_hello"):      # told why, then hung up on
            assert [m["type"] for m in s["got"][1:]] == ["refused"] and why in s["got"][1]["message"], s
    assert seen["silent"]["got"][1:] == [] and seen["silent"]["error"] is None      # hung up on after 5 s

    versions = "protocol version 2 is not this listener's 1: run the same hotspare version on every host"
    assert other.returncode == 2, out
    assert f"did not welcome node hostv2: {versions}" in out
    assert re.search(rf"hotspare-node-endpoint: refused a connection from {re.escape(net['hosta'].addr)}:\d+: "
                     + re.escape(versions), log), log
    assert "hostv2" not in report["nodes"]

    assert from_a["port"] is None and from_a["error"].startswith("ConnectionRefusedError"), from_a
    assert "w2" in {w["worker"] for w in report["nodes"]["hostb"]["workers"]}     # posing as a real worker
    assert on_b["got"][0]["type"] == "challenge" and on_b["got"][1:] == [], on_b
    assert (f"agent-accept: refused a connection from 127.0.0.1:{on_b['port']}: worker 'w2' failed authentication"
            in job.agent_logs["hostb"].text())

    assert code == 0, log
    assert report["final_state_digest"] == reference, "the run under attack diverged from the one-host run"
    assert report["replicas_consistent"] and report["steps_completed"] == STEPS
    assert report["failures_total"] == 0 and report["steps_repeated"] == 0 and report["steps_lost"] == 0
    assert {n: len(v["workers"]) for n, v in report["nodes"].items()} == {"hosta": 2, "hostb": 2, "hostc": 2}
    assert all(proc.returncode == 0 for proc in job.agents.values())
