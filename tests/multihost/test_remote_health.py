"""A remote host's devices are watched and diagnosed where they are: each agent polls its own
host (simulated cpu slots here) and sends the readings up; a device that turns hot mid-run on
hostb has its rank live-migrated to the spare host, and its quarantine diagnostics run on
hostb's agent, whose verdict brings it back. The run ends bitwise equal to the fault-free
one-host run. About 60 s on 2 cores: marked slow."""
import pytest

from hotspare.health.lifecycle import State
from hotspare.health.registry import Registry
from hotspare.testing import run_job
from hotspare.testing.hostjob import HostJob

pytestmark = pytest.mark.slow
STEPS = 400
ARGS = ["--model", "tiny", "--steps", str(STEPS)]


@pytest.fixture(scope="module")
def one_host_reference():
    result = run_job(ARGS, nproc=4, spares=2)
    assert result.code == 0, result.output
    return result.digest


def test_a_remote_device_turning_hot_migrates_its_rank_and_is_diagnosed_on_its_host(
        net, secret_file, one_host_reference, tmp_path):
    db = tmp_path / "health.json"
    job = HostJob(net, secret_file, str(tmp_path / "r.json"), ARGS, agent_extra=["--allow-inject"],
                  extra=["--log-every", "10", "--telemetry-period", "0.5",       # the default lease: no host is lost here
                         "--health-db", str(db), "--inject", "thermal:rank=2:step=100:temp=92"])
    try:
        code, report = job.finish()
    finally:
        job.stop()
    log, hostb = job.log.text(), job.agent_logs["hostb"].text()
    assert code == 0, "\n".join([log, *(f"--- {n}\n{o.text()}" for n, o in job.agent_logs.items())])
    assert report["final_state_digest"] == one_host_reference, "the multi-host run diverged from the one-host run"
    assert report["replicas_consistent"] and report["steps_completed"] == STEPS
    assert report["steps_repeated"] == 0 and report["steps_lost"] == 0 and report["failures_total"] == 0, log
    # hostb's agent drove its own simulated device and polled it; the launcher's rule fired on it
    assert "FAULT   thermal" in hostb and "the simulated telemetry of hostb/cpu0 now reads it" in hostb, hostb
    assert "SIMULATED readings of 2 cpu slot(s)" in hostb and "polled every 0.5 s" in hostb, hostb
    (m,) = report["migrations"]
    assert (m["rank"], m["device"], m["rule"], m["outcome"], m["lost_steps"]) == (
        2, "hostb/cpu0", "temp-limit", "migrated", 0), log
    # the spare that took rank 2 is one of the spare host's; the worker that left was hostb's
    workers = {n: {w["worker"] for w in v["workers"]} for n, v in report["nodes"].items()}
    assert m["spare"] in workers["hostc"] and m["worker"] in workers["hostb"], report["nodes"]
    assert any(e["device"] == "hostb/cpu0" and e["source"] == "simulated" for e in report["health_events"])
    # the quarantine diagnostics ran on hostb's agent: it reset the device and started each pass,
    # and the two verdicts came from node hostb
    assert "QUARANTINE hostb/cpu0: diagnostics pass starting on this node, after a reset" in hostb, hostb
    assert hostb.count("QUARANTINE hostb/cpu0: diagnostics pass starting on this node") == 2, hostb
    assert "QUARANTINE hostb/cpu0: drained; diagnostics started on node hostb" in log
    assert "diagnostics pass 1/2 on node hostb: " in log and "diagnostics pass 2/2 on node hostb: " in log, log
    assert "HEALTHY hostb/cpu0: back in the pool after 2 passing diagnostics" in log, log
    # the launcher's registry is the record of the remote devices
    reg = Registry(db)
    assert [t.dst.value for t in reg.get("hostb/cpu0").history] == ["cordoned", "draining", "quarantined", "healthy"]
    assert reg.get("hostb/cpu0").state == State.HEALTHY
    assert {d["device"] for d in report["devices"]} == {f"host{h}/cpu{i}" for h in "abc" for i in range(2)}
