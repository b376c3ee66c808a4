"""Device health under the coordinator service, across 3 network namespaces: each host's agent
polls its own (simulated) devices for the job placed on it and runs their checks. A device
of hostb turns hot mid-run (an injected fault, through `hotspare inject --coordinator`); its
rank is live-migrated to the spare host, hostb's agent diagnoses the device in quarantine,
and the verdict brings it back. The device's whole life is in the service's database, and
the run ends bitwise equal to the same job on one host. About 60 s on 2 cores: slow."""
import pytest

from hotspare.health.lifecycle import State
from hotspare.health.registry import Registry
from hotspare.testing import run_job
from hotspare.testing.local import EXAMPLE
from hotspare.testing.servicejob import ServiceCluster

pytestmark = pytest.mark.slow
STEPS = 400
ARGS = ["--model", "tiny", "--steps", str(STEPS)]


@pytest.fixture(scope="module")
def reference4():
    result = run_job(ARGS, nproc=4, spares=1)
    assert result.code == 0, result.output
    return result.digest


def test_a_device_turning_hot_in_a_service_job_migrates_its_rank_and_is_diagnosed_on_its_host(
        net, secret_file, reference4, tmp_path):
    # The diagnostics of hostb/cpu0 burn CPU on hostb beside rank 3: on this 2-core machine its
    # steps slow down, which the straggler rule rightly sees (and moves it too). Not this test's
    # subject: the job runs with that rule turned to "ignore".
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nname = "straggler"\naction = "ignore"\n')
    cluster = ServiceCluster(net, secret_file, str(tmp_path / "state"), allow_inject=True)
    try:
        for host in ("hosta", "hostb"):
            cluster.start_agent(host)
        cluster.start_agent("hostc", spare=True)
        job = cluster.submit(2, 2, 1, str(EXAMPLE), ARGS,
                             run_args=["--log-every", "10", "--telemetry-period", "0.5", "--allow-inject",
                                       "--health-rules", str(rules)])
        cluster.log.wait_for(rf"\[{job}\] step\s+100/", 120)
        said = cluster.inject(job, "thermal:rank=2:temp=92")      # rank 2: hostb's first slot
        assert "armed: fires on rank 2" in said, said
        row, report = cluster.wait_job(job)
        log, hostb = cluster.log.text(), cluster.agents["hostb"].text()
    finally:
        cluster.close()
    assert row["state"] == "finished" and row["code"] == 0, log
    assert report["final_state_digest"] == reference4, "the run diverged from the one-host run"
    assert report["replicas_consistent"] and report["steps_completed"] == STEPS
    assert report["steps_repeated"] == 0 and report["steps_lost"] == 0 and report["failures_total"] == 0, log
    # hostb's agent polled its devices for this job and drove the injected fault into one of them
    assert "polled every 0.5 s, sent to the coordinator" in hostb, hostb
    assert "the simulated telemetry of hostb/cpu0 now reads it" in hostb, hostb
    (m,) = report["migrations"]
    assert (m["rank"], m["device"], m["rule"], m["outcome"], m["lost_steps"]) == (
        2, "hostb/cpu0", "temp-limit", "migrated", 0), log
    workers = {n: {w["worker"] for w in v["workers"]} for n, v in report["nodes"].items()}
    assert m["spare"] in workers["hostc"] and m["worker"] in workers["hostb"], report["nodes"]
    # the quarantine diagnostics ran on hostb's agent, and their verdicts brought the device back
    assert hostb.count("QUARANTINE hostb/cpu0: diagnostics pass starting on this node") == 2, hostb
    assert f"[{job}] QUARANTINE hostb/cpu0: drained; diagnostics started on node hostb" in log, log
    assert f"[{job}] HEALTHY hostb/cpu0: back in the pool after 2 passing diagnostics" in log, log
    # its record is in the service's database, beside the jobs
    reg = Registry(tmp_path / "state" / "coordinator.db")
    assert [t.dst.value for t in reg.get("hostb/cpu0").history] == ["cordoned", "draining", "quarantined", "healthy"]
    assert reg.get("hostb/cpu0").state == State.HEALTHY and reg.get("hosta/cpu0").state == State.HEALTHY
    assert {d["device"]: d["state"] for d in report["devices"]}["hostb/cpu0"] == "healthy"
