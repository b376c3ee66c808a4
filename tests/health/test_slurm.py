"""Cordoning a device drains its node in a real Slurm, and returning it resumes the node.

Runs against a real single-machine Slurm (slurmctld + slurmd + munge on this host, node name
``hostname -s``). ``.ci/slurm-up`` installs and starts one; the session fixture ``hotspare_slurm_node``
(tests/conftest.py, hotspare/testing/slurm.py) starts it itself when the binaries are installed but
the daemons are not running, and stops what it started.
Without Slurm installed the tests fail (they do not skip): run ``.ci/slurm-up`` as root.
What Slurm reports is read with ``sinfo`` directly, independently of hotspare's own Slurm code.
"""
import os
import subprocess
import sys
import time

import pytest

from hotspare.health.reconcile import SlurmReconciler
from hotspare.health.registry import Registry
from hotspare.health.slurm import SlurmError, SlurmNodes
from hotspare.testing.slurm import sh, sinfo_reason, sinfo_state, wait_state


@pytest.fixture
def node(hotspare_slurm_node):
    """The node, idle, with no job; left idle with no job afterwards whatever the test did."""
    n = hotspare_slurm_node

    def clean():
        sh("scancel", "--user", str(os.getuid()))
        if "drain" in sinfo_state(n):
            sh("scontrol", "update", f"NodeName={n}", "State=RESUME")
        wait_state(n, ("idle",))

    clean()
    yield n
    clean()


def hotspare(*args, env=None):
    return subprocess.run([sys.executable, "-m", "hotspare", *map(str, args)], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, **(env or {})))


def test_cordon_drains_the_node_in_slurm_and_uncordon_resumes_it(node, tmp_path):
    db = tmp_path / "health.json"
    reg = Registry(db)
    reg.ensure(f"{node}/cpu0")
    reg.ensure(f"{node}/cpu1")

    out = hotspare("cordon", f"{node}/cpu0", "--reason", "thermal margin -3C", "--db", db, "--slurm", "on")
    assert out.returncode == 0, out.stderr
    assert f"slurm: drained node {node}" in out.stdout
    assert sinfo_state(node) == "drained"
    assert sinfo_reason(node) == f"hotspare: {node}/cpu0 cordoned: thermal margin -3C"

    # A second device of the node out of service: the node stays drained until both are back.
    assert hotspare("drain", f"{node}/cpu1", "--reason", "ecc", "--db", db, "--slurm", "on").returncode == 0
    out = hotspare("uncordon", f"{node}/cpu0", "--db", db, "--slurm", "on")
    assert out.returncode == 0, out.stderr
    assert sinfo_state(node) == "drained"
    assert sinfo_reason(node) == f"hotspare: {node}/cpu1 draining: ecc"

    out = hotspare("uncordon", f"{node}/cpu1", "--db", db, "--slurm", "on")
    assert out.returncode == 0, out.stderr
    assert f"slurm: resumed node {node}" in out.stdout
    assert wait_state(node, ("idle",)) == "idle"
    assert sinfo_reason(node) == ""


def test_a_running_job_keeps_running_while_the_node_drains(node, tmp_path):
    job = sh("sbatch", "--parsable", "--output=/dev/null", "--wrap", "sleep 300").stdout.strip()
    assert job, "sbatch gave no job id"
    wait_state(node, ("allocated", "mixed"))
    reg = Registry(tmp_path / "health.json")
    slurm = SlurmReconciler(reg, SlurmNodes())
    reg.ensure(f"{node}/cpu0")
    reg.cordon(f"{node}/cpu0", "pcie link x8 of x16", actor="rule:pcie-degraded")
    assert sinfo_state(node) in ("allocated", "mixed"), "the registry write alone touches no Slurm"
    slurm.reconcile()
    assert sinfo_state(node) == "draining"            # no new jobs; the running one stays
    assert sh("squeue", "--noheader", "--jobs", job, "--format", "%T").stdout.strip() == "RUNNING"
    sh("scancel", job)
    assert wait_state(node, ("drained",)) == "drained"
    assert slurm.slurm.state(node).by_hotspare
    reg.uncordon(f"{node}/cpu0")
    slurm.reconcile()
    wait_state(node, ("idle",))


def test_a_node_drained_by_someone_else_is_left_alone(node, tmp_path):
    assert sh("scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=admin: bios update").returncode == 0
    reg = Registry(tmp_path / "health.json")
    slurm = SlurmReconciler(reg, SlurmNodes())
    reg.ensure(f"{node}/cpu0")
    reg.cordon(f"{node}/cpu0", "thermal")
    assert any("drained by someone else (admin: bios update)" in n for n in slurm.reconcile().notes)
    reg.uncordon(f"{node}/cpu0")
    slurm.reconcile()
    assert sinfo_state(node) == "drained" and sinfo_reason(node) == "admin: bios update"


def test_strict_mode_reports_a_node_slurm_does_not_know_and_keeps_it_to_retry(node, tmp_path):
    # The registry holds the desired state: the cordon is written whatever Slurm says; strict
    # mode makes Slurm's refusal the command's error, and the registry records it for the retry.
    db = tmp_path / "health.json"
    Registry(db).ensure("not-a-slurm-node/gpu0")
    out = hotspare("cordon", "not-a-slurm-node/gpu0", "--reason", "x", "--db", db, "--slurm", "on")
    assert out.returncode == 1
    assert "Slurm does not know node 'not-a-slurm-node'" in out.stderr and "retried" in out.stderr
    reg = Registry(db)
    assert reg.get("not-a-slurm-node/gpu0").state.value == "cordoned"
    status = reg.slurm_status()["not-a-slurm-node"]
    assert status.want == "hotspare: not-a-slurm-node/gpu0 cordoned: x"
    assert "Slurm does not know node" in status.error
    shown = hotspare("health", "--db", db, "--slurm", "off")
    assert "not-a-slurm-node: the last reconcile failed" in shown.stdout, shown.stdout

    retry = hotspare("health", "--sync-slurm", "--db", db, "--slurm", "on")    # still unknown: fails again
    assert retry.returncode == 1 and "Slurm does not know node" in retry.stderr

    # auto mode (this host has a slurm.conf now): unknown nodes are skipped, the error is cleared.
    out = hotspare("health", "--sync-slurm", "--db", db, env={"HOTSPARE_SLURM": "auto"})
    assert out.returncode == 0, out.stderr
    assert Registry(db).slurm_status()["not-a-slurm-node"].error is None


def test_a_refused_drain_is_retried_by_the_reconciler_until_slurm_follows(node, tmp_path):
    reg = Registry(tmp_path / "health.json")
    reg.ensure(f"{node}/cpu0")
    broken = SlurmReconciler(reg, SlurmNodes(scontrol="/nonexistent/scontrol"))   # the call fails
    reg.cordon(f"{node}/cpu0", "thermal")
    with pytest.raises(SlurmError, match="not found on PATH"):
        broken.reconcile()
    assert sinfo_state(node) == "idle" and reg.slurm_status()[node].error
    slurm = SlurmReconciler(reg, SlurmNodes())
    slurm.start(period_s=0.5, check_s=0.1, log=lambda line: None)     # the periodic retry
    try:
        assert wait_state(node, ("drained",)) == "drained"
        deadline = time.monotonic() + 10
        while reg.slurm_status()[node].error is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert reg.slurm_status()[node].error is None
        reg.uncordon(f"{node}/cpu0")                  # a write: reconciled within check_s
        assert wait_state(node, ("idle",)) == "idle"
    finally:
        slurm.stop(log=lambda line: None)


def test_scontrol_failures_carry_its_stderr(node):
    with pytest.raises(SlurmError, match=r"scontrol update NodeName=nosuchnode .* failed \(exit 1\): "
                                         r".*Invalid node name specified"):
        SlurmNodes().drain("nosuchnode", "x")


def test_auto_mode_is_on_where_slurm_is_configured(node):
    assert SlurmNodes.detected()
    assert SlurmNodes.from_mode("auto") is not None and not SlurmNodes.from_mode("auto").strict
    assert SlurmNodes.from_mode("off") is None
    assert SlurmNodes().unreachable() is None            # the controller answers scontrol ping
    assert SlurmNodes.detected({"PATH": "/nonexistent"}) is False


# --- the pure part: what to ask Slurm for (no cluster needed) -----------------------------------
from hotspare.health.slurm import NodeState, node_reason, plan  # noqa: E402


def test_the_node_reason_names_the_first_device_and_counts_the_rest():
    assert node_reason(()) is None
    assert node_reason([("n1/gpu3", "cordoned", "thermal\nmargin")]) == "hotspare: n1/gpu3 cordoned: thermal margin"
    two = node_reason([("n1/gpu3", "draining", "ecc"), ("n1/gpu1", "cordoned", "fan")])
    assert two == "hotspare: n1/gpu1 cordoned: fan (+1 more device)"
    long = node_reason([("n1/gpu1", "cordoned", "x" * 500), ("n1/gpu2", "cordoned", "y"), ("n1/gpu3", "retired", "z")])
    assert len(long) == 200 and long.endswith("... (+2 more devices)")


@pytest.mark.parametrize("state,reason,want,action", [
    ("idle", "", "hotspare: a", "drain"),
    ("allocated", "", "hotspare: a", "drain"),
    ("drained", "hotspare: a", "hotspare: a", None),          # already as wanted: no call
    ("drained", "hotspare: a", "hotspare: b", "drain"),       # our drain, new reason: re-label
    ("drained", "admin: bios", "hotspare: a", None),          # someone else's drain: leave it
    ("draining", "hotspare: a", None, "resume"),
    ("drained", "admin: bios", None, None),                   # never resume someone else's drain
    ("idle", "", None, None),
    ("down", "not responding", "hotspare: a", "drain"),
])
def test_plan_only_undoes_its_own_drains(state, reason, want, action):
    assert plan(NodeState("n1", state, reason), want) == action


def test_auto_mode_leaves_a_controller_that_does_not_answer_alone_for_the_run(tmp_path):
    """A host with slurm.conf but no controller answering (a dead slurmctld, a config copied from
    elsewhere): the run says so once, and neither its reconciles nor its end wait on Slurm."""
    calls = tmp_path / "calls"
    for tool in ("scontrol", "sinfo"):
        (tmp_path / tool).write_text(f"#!/bin/sh\necho {tool} \"$@\" >> {calls}\n"
                                     "echo 'slurm_load_partitions: Unable to contact slurm controller' >&2\nexit 1\n")
        (tmp_path / tool).chmod(0o755)
    reg = Registry(tmp_path / "health.json")
    reg.ensure("n1/cpu0")
    reg.cordon("n1/cpu0", "thermal")
    slurm = SlurmReconciler(reg, SlurmNodes(strict=False, scontrol=str(tmp_path / "scontrol"),
                                            sinfo=str(tmp_path / "sinfo")))
    said: list[str] = []
    slurm.start(check_s=0.05, log=said.append)
    time.sleep(0.3)
    slurm.stop(log=said.append)
    assert calls.read_text().splitlines() == ["scontrol ping"]       # asked once, then left alone
    assert len(said) == 1 and "the Slurm controller does not answer" in said[0]
    assert "Unable to contact slurm controller" in said[0] and "hotspare health --sync-slurm" in said[0]
    # strict (--slurm on) keeps asking, and says what failed
    strict = SlurmReconciler(reg, SlurmNodes(strict=True, scontrol=str(tmp_path / "scontrol"),
                                             sinfo=str(tmp_path / "sinfo")))
    with pytest.raises(SlurmError, match="Unable to contact slurm controller"):
        strict.reconcile()


def test_the_slurm_mode_comes_from_the_environment_where_no_flag_says():
    from hotspare.health.slurm import mode_from_env
    assert mode_from_env({}) == "auto"
    assert mode_from_env({"HOTSPARE_SLURM": "off"}) == "off"
