"""An agent under srun takes its node name and device slots from Slurm's environment
(hotspare/agent/slurm_env.py). The environments below are what srun set for real tasks (Slurm
22.05, `srun -l env`), trimmed to the variables that matter."""
import subprocess
import sys

import pytest

from hotspare.agent.slurm_env import agent_defaults, gpu_count, slurm_task, tasks_per_node
from hotspare.errors import ConfigError


def srun_task(node="gpu-07", localid=0, tasks=3, nodes=3, per_node="1(x3)", nodeid=0, **more):
    """One task's environment as srun sets it."""
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(localid), "SLURMD_NODENAME": node,
           "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid), "SLURM_STEP_NUM_TASKS": str(tasks),
           "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_TASKS_PER_NODE": per_node,
           "SLURM_NTASKS": str(tasks), "SLURM_NNODES": str(nodes), "SLURM_TASKS_PER_NODE": per_node}
    return {**env, **{k: str(v) for k, v in more.items()}}


def test_outside_slurm_the_host_name_and_one_cpu_slot():
    d = agent_defaults({"PATH": "/usr/bin"}, "myhost")
    assert (d.name, d.devices) == ("myhost", "cpu:1") and d.name_from == "the host name"


def test_the_batch_script_itself_is_not_an_srun_task():
    # sbatch's batch step sets SLURM_JOB_ID, SLURM_PROCID and SLURMD_NODENAME, but no SLURM_STEP_ID
    batch = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURMD_NODENAME": "vm",
             "SLURM_NTASKS": "3", "SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": "3", "SLURM_CPUS_PER_TASK": "4"}
    assert slurm_task(batch) is None
    assert agent_defaults(batch, "vm.example.org").name == "vm.example.org"


def test_one_task_per_node_is_named_after_its_slurm_node():
    d = agent_defaults(srun_task(node="gpu-07", nodeid=1), "gpu-07.cluster.example")
    assert d.name == "gpu-07" and d.name_from == "SLURMD_NODENAME=gpu-07"


def test_several_tasks_on_a_node_get_their_local_id_so_names_stay_unique():
    envs = [srun_task(node="vm", localid=i, tasks=3, nodes=1, per_node="3") for i in range(3)]
    names = [agent_defaults(e, "vm").name for e in envs]
    assert names == ["vm.0", "vm.1", "vm.2"]
    assert "SLURM_LOCALID=1" in agent_defaults(envs[1], "vm").name_from


def test_uneven_steps_name_every_task_by_one_rule():
    # 3 tasks on 2 nodes ("2,1"): the lone task of node b is b.0, not b, so the layout is readable
    a1 = srun_task(node="a", localid=1, tasks=3, nodes=2, per_node="2,1", nodeid=0)
    b0 = srun_task(node="b", localid=0, tasks=3, nodes=2, per_node="2,1", nodeid=1)
    assert [agent_defaults(e, "x").name for e in (a1, b0)] == ["a.1", "b.0"]
    assert slurm_task(a1).tasks_on_node == 2 and slurm_task(b0).tasks_on_node == 1


def test_devices_from_cpus_per_task():
    d = agent_defaults(srun_task(SLURM_CPUS_PER_TASK=6), "h")
    assert d.devices == "cpu:6" and d.devices_from.startswith("SLURM_CPUS_PER_TASK=6")


def test_devices_default_to_one_slot_when_slurm_says_nothing():
    d = agent_defaults(srun_task(), "h")
    assert d.devices == "cpu:1" and "srun -c N" in d.devices_from


def test_gpus_of_the_task_come_before_its_cpus():
    d = agent_defaults(srun_task(SLURM_GPUS_PER_TASK="a100:4", SLURM_GPUS_ON_NODE=8, SLURM_CPUS_PER_TASK=32), "h")
    assert d.devices == "cpu:4" and d.devices_from.startswith("SLURM_GPUS_PER_TASK=a100:4")


def test_gpus_of_the_node_when_one_agent_holds_the_node():
    d = agent_defaults(srun_task(SLURM_GPUS_ON_NODE=8, SLURM_CPUS_PER_TASK=32), "h")
    assert d.devices == "cpu:8" and d.devices_from.startswith("SLURM_GPUS_ON_NODE=8")


def test_gpus_of_a_node_shared_by_two_agent_tasks_are_not_guessed():
    env = srun_task(node="vm", localid=1, tasks=2, nodes=1, per_node="2", SLURM_GPUS_ON_NODE=8)
    with pytest.raises(ConfigError, match="shared by 2 agent tasks.*--gpus-per-task"):
        agent_defaults(env, "vm")


@pytest.mark.parametrize("spec,counts", [("3", [3]), ("2(x3),1", [2, 2, 2, 1]), ("1(x2),4(x1)", [1, 1, 4])])
def test_slurm_task_count_lists(spec, counts):
    assert tasks_per_node(spec) == counts


def test_gpu_counts():
    assert gpu_count("2") == 2 and gpu_count("a100:2") == 2 and gpu_count("a100:1,v100:2") == 3
    with pytest.raises(ConfigError):
        gpu_count("a100")


def test_a_broken_srun_environment_is_an_error_that_names_the_variable():
    with pytest.raises(ConfigError, match="SLURMD_NODENAME"):
        slurm_task({"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0"})
    with pytest.raises(ConfigError, match="SLURM_LOCALID='x'"):
        slurm_task(srun_task(SLURM_LOCALID="x"))
    with pytest.raises(ConfigError, match="SLURM_STEP_TASKS_PER_NODE"):
        slurm_task(srun_task(per_node="two"))


def _agent(env, *args):
    return subprocess.run([sys.executable, "-m", "hotspare", "agent", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_the_agent_takes_its_coordinator_from_the_environment_and_logs_its_slurm_identity(tmp_path):
    import os
    secret = tmp_path / "s"
    secret.write_text("ab" * 32)
    secret.chmod(0o600)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    # nothing listens on port 9 of loopback: the agent gets as far as connecting, and says so
    env = {**base, **srun_task(node="vm", localid=2, tasks=3, nodes=1, per_node="3", SLURM_CPUS_PER_TASK=2),
           "HOTSPARE_COORDINATOR": "127.0.0.1:9"}
    out = _agent(env, "--secret-file", str(secret))
    assert out.returncode == 2
    assert "hotspare agent vm.2: node name vm.2 from SLURMD_NODENAME=vm, SLURM_LOCALID=2" in out.stderr
    assert "hotspare agent vm.2: devices cpu:2 from SLURM_CPUS_PER_TASK=2" in out.stderr
    assert "cannot reach the coordinator at 127.0.0.1:9" in out.stderr
    # flags win over the environment, and say nothing about Slurm
    out = _agent(env, "--secret-file", str(secret), "--name", "n1", "--devices", "cpu:1", "--coordinator",
                 "127.0.0.1:7")
    assert "from SLURM" not in out.stderr and "cannot reach the coordinator at 127.0.0.1:7" in out.stderr
    # no coordinator anywhere: the error says both ways to give it
    out = _agent(base, "--secret-file", str(secret))
    assert out.returncode == 2 and "give --coordinator ADDR:PORT (or export HOTSPARE_COORDINATOR" in out.stderr
