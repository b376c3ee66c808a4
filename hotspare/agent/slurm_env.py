"""What a node agent started by ``srun`` learns from Slurm's environment: its node name and its
device slots. Pure: an environment dict in, defaults and the reason for each out (no I/O).

An agent is "under srun" when ``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` are set (srun sets both for
every task; a batch script itself has no ``SLURM_STEP_ID``, so an agent started there directly is
treated as a plain host).

Node name (unless ``--name``):
  ``SLURMD_NODENAME`` (the Slurm node the task runs on) when the step runs one task per node;
  ``SLURMD_NODENAME.SLURM_LOCALID`` on every node when it runs more tasks than nodes
  (``SLURM_STEP_NUM_TASKS > SLURM_STEP_NUM_NODES``), so two agents of one node never share a name.
  The whole step follows one rule, so the names tell the layout.

Device slots (unless ``--devices``), one per worker or spare the agent may hold:
  1. ``SLURM_GPUS_PER_TASK`` (``srun --gpus-per-task``): one slot per GPU of the task;
  2. ``SLURM_GPUS_ON_NODE`` with one agent task on the node: one slot per GPU of the node (with
     several agent tasks on a node the GPUs would be shared: refused, give --gpus-per-task);
  3. ``SLURM_CPUS_PER_TASK`` (``srun -c N``): one slot per CPU of the task;
  4. otherwise ``cpu:1``, as outside Slurm.
  Slots are named ``NODE/cpuI`` whatever backs them (remote agents name no GPU slots yet); a
  worker's ``LOCAL_RANK`` is its slot's index, so with GPUs it is the worker's ``cuda:LOCAL_RANK``
  among the GPUs Slurm made visible to the task.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from hotspare.errors import ConfigError


@dataclass(frozen=True)
class SlurmTask:
    """The srun task this process is, as its environment says."""
    job_id: str
    step_id: str
    node: str               # SLURMD_NODENAME
    local_id: int           # SLURM_LOCALID: the task's index among the step's tasks on this node
    step_tasks: int         # SLURM_STEP_NUM_TASKS
    step_nodes: int         # SLURM_STEP_NUM_NODES
    tasks_on_node: int      # from SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID

    @property
    def shares_nodes(self) -> bool:
        """The step runs more tasks than nodes: some node holds more than one agent."""
        return self.step_tasks > self.step_nodes


@dataclass(frozen=True)
class AgentDefaults:
    name: str
    name_from: str          # why: "host name" or the Slurm variables it came from
    devices: str            # a --devices spec: cpu:N
    devices_from: str


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed count list: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE={spec!r}: not a Slurm task count list")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _int(env: Mapping[str, str], var: str, default: int | None = None) -> int:
    value = env.get(var)
    if value is None or value == "":
        if default is None:
            raise ConfigError(f"{var} is not set, but srun sets it for every task")
        return default
    if not value.strip().isdigit():
        raise ConfigError(f"{var}={value!r}: expected a count")
    return int(value)


def slurm_task(env: Mapping[str, str]) -> SlurmTask | None:
    """The srun task of this environment, or None outside an srun step."""
    if not env.get("SLURM_JOB_ID") or env.get("SLURM_STEP_ID") in (None, ""):
        return None
    node = env.get("SLURMD_NODENAME") or ""
    if not node:
        raise ConfigError("SLURM_STEP_ID is set but SLURMD_NODENAME is not: not an srun task's environment")
    step_tasks = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1))
    step_nodes = _int(env, "SLURM_STEP_NUM_NODES", _int(env, "SLURM_NNODES", 1))
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node_id = _int(env, "SLURM_NODEID", 0)
    if per_node:
        counts = tasks_per_node(per_node)
        on_node = counts[node_id] if node_id < len(counts) else max(counts)
    else:
        on_node = -(-step_tasks // step_nodes)
    return SlurmTask(job_id=env["SLURM_JOB_ID"], step_id=env["SLURM_STEP_ID"], node=node,
                     local_id=_int(env, "SLURM_LOCALID", 0), step_tasks=step_tasks, step_nodes=step_nodes,
                     tasks_on_node=on_node)


def gpu_count(spec: str) -> int:
    """``SLURM_GPUS_PER_TASK``: ``"2"``, ``"a100:2"`` or ``"a100:1,v100:1"`` -> the number of GPUs."""
    total = 0
    for item in spec.split(","):
        count = item.rsplit(":", 1)[-1].strip()
        if not count.isdigit():
            raise ConfigError(f"SLURM_GPUS_PER_TASK={spec!r}: expected [TYPE:]COUNT[,...]")
        total += int(count)
    return total


def agent_defaults(env: Mapping[str, str], hostname: str) -> AgentDefaults:
    """The agent's default node name and device slots in ``env`` (``hostname``: this host's
    name, the default outside Slurm)."""
    task = slurm_task(env)
    if task is None:
        return AgentDefaults(hostname, "the host name", "cpu:1", "the default")
    if task.shares_nodes:
        name = f"{task.node}.{task.local_id}"
        name_from = (f"SLURMD_NODENAME={task.node}, SLURM_LOCALID={task.local_id} "
                     f"({task.step_tasks} tasks on {task.step_nodes} node(s))")
    else:
        name, name_from = task.node, f"SLURMD_NODENAME={task.node}"
    return AgentDefaults(name, name_from, *_devices(env, task))


def _devices(env: Mapping[str, str], task: SlurmTask) -> tuple[str, str]:
    per_task = env.get("SLURM_GPUS_PER_TASK")
    if per_task:
        n = gpu_count(per_task)
        if n > 0:
            return f"cpu:{n}", f"SLURM_GPUS_PER_TASK={per_task}: one slot per GPU of the task"
    on_node = _int(env, "SLURM_GPUS_ON_NODE", 0)
    if on_node > 0:
        if task.tasks_on_node > 1:
            raise ConfigError(f"Slurm gave this node {on_node} GPU(s) (SLURM_GPUS_ON_NODE) shared by "
                              f"{task.tasks_on_node} agent tasks: run one agent per node, or give each "
                              f"its own (srun --gpus-per-task N), or pass --devices")
        return f"cpu:{on_node}", f"SLURM_GPUS_ON_NODE={on_node}: one slot per GPU of the node"
    cpus = _int(env, "SLURM_CPUS_PER_TASK", 0)
    if cpus > 0:
        return f"cpu:{cpus}", f"SLURM_CPUS_PER_TASK={cpus}: one slot per CPU of the task"
    return "cpu:1", "the default (Slurm set neither SLURM_GPUS_* nor SLURM_CPUS_PER_TASK: srun -c N sets it)"
