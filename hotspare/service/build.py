"""How a job is put together from its typed configuration: the workers' contract, the ledger,
the cluster view and the coordinator. ``hotspare run`` (one launcher, one job) and the
coordinator service (``hotspare coordinator``, many jobs) build their jobs here, the same way."""
from __future__ import annotations

import os
import queue

from hotspare.config.preflight import Preflight
from hotspare.config import RunConfig
from hotspare.errors import ConfigError
from hotspare.protocol.workerenv import JobEnv


def job_env(cfg: RunConfig, pre: Preflight) -> JobEnv:
    """The job-wide part of every worker's contract (hotspare/protocol/workerenv.py)."""
    c = cfg.checkpoint
    return JobEnv(backend=cfg.launch.backend, join_timeout_s=cfg.hang.join_timeout,
                  fingerprint_every=cfg.health.fingerprint_every,
                  # Workers write (and restore) only inside these, signed with the key file named here.
                  checkpoint_dir=checkpoint_dir(cfg), checkpoint_every=c.checkpoint_every,
                  checkpoint_seconds=c.checkpoint_seconds, checkpoint_key=pre.key_file,
                  resume_dir=os.path.abspath(c.resume) if c.resume else None)


def injecting(cfg: RunConfig) -> bool:
    """Whether this job loads the fault-injection plug-in: --inject, or --allow-inject for
    `hotspare inject` into the running job."""
    return bool(cfg.faults.inject) or cfg.faults.allow_inject


def checkpoint_dir(cfg: RunConfig) -> str:
    """Where checkpoints go: --checkpoint-dir, else ./hotspare-checkpoints for the last one of a
    job that stops for lack of capacity."""
    return os.path.abspath(cfg.checkpoint.checkpoint_dir or "hotspare-checkpoints")


def health_desk(cfg: RunConfig, pre: Preflight, registry, log, devices=(), poll=None, reset=None,
                adopt: bool = False):
    """The job's health desk (``coordinator.health.HealthMonitor``) over the device ``registry``:
    the rules (--health-rules, else the defaults), --admission; ``devices``: this host's, polled
    by ``poll``; ``adopt``: remote hosts' devices join as their agents connect."""
    from hotspare.coordinator.health import HealthMonitor
    from hotspare.health.rulefile import load_rules
    return HealthMonitor(pre.rules or load_rules(), registry, list(devices), log=log, poll=poll, reset=reset,
                         admission=cfg.health.admission, adopt=adopt)


def control_plane(cfg: RunConfig, pre: Preflight, events: "queue.Queue", health, log, job: str = ""):
    """The ledger, the cluster view and the coordinator, their settings taken from the config
    here and nowhere else; ``job``: the job's id in the coordinator service (its worker ids
    begin with it)."""
    from hotspare.coordinator import Coordinator, CoordinatorSettings, Ledger
    from hotspare.coordinator.nodes import Nodes
    from hotspare.policy.decide import ClusterView
    c, hang = cfg.checkpoint, cfg.hang
    settings = {"script": cfg.script, "args": list(cfg.script_args), "nproc": cfg.launch.nproc,
                "spares": cfg.capacity.spares, "inject": [str(f) for f in pre.faults],
                "checkpoint_dir": c.checkpoint_dir, "checkpoint_every": c.checkpoint_every,
                "resume": c.resume, "hang_floor_s": hang.hang_floor, "hang_factor": hang.hang_factor,
                "backend": cfg.launch.backend}
    ledger = Ledger(settings)
    ledger.checkpoint_fallbacks.extend(pre.fallbacks)
    elastic = cfg.capacity.elastic
    if elastic is not None and elastic > cfg.launch.nproc:
        raise ConfigError(f"--elastic {elastic}: the job has {cfg.launch.nproc} ranks; give 1..{cfg.launch.nproc}")
    view = ClusterView(world_size=cfg.launch.nproc, target_spares=cfg.capacity.spares, resume=pre.resume_path,
                       replacements_left=cfg.capacity.max_replacements, capacity_wait=cfg.capacity.capacity_wait,
                       elastic_min=elastic, placement=None if elastic is None else tuple(range(cfg.launch.nproc)))
    # Fault injection is a testing plug-in, loaded only when asked for (hotspare.testing.faults).
    plugins = []
    if injecting(cfg):
        from hotspare.testing.faults import CoordinatorFaults
        plugins.append(CoordinatorFaults(pre.faults))
    settings = CoordinatorSettings(log_every=cfg.launch.log_every, hang_floor=hang.hang_floor,
                                   hang_factor=hang.hang_factor, join_timeout=hang.join_timeout,
                                   checkpoint_dir=checkpoint_dir(cfg), checkpoint_key=pre.key)
    coord = Coordinator(Nodes(usable=health.usable if health else (lambda d: True), job=job), events, view, ledger,
                        settings, log=log, health=health, plugins=plugins)
    return ledger, coord


# What a remote agent's workers get from the launcher's environment (the rest is their own host's).
JOB_VARS = ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "GROUP_RANK",
             "TORCHELASTIC_RUN_ID", "PYTHONUNBUFFERED", "OMP_NUM_THREADS")


def remote_job_env(env: dict[str, str]) -> dict[str, str]:
    """The part of the launcher's worker environment ``env`` that agents on other hosts hand
    their workers: torchrun's job variables and the worker contract."""
    from hotspare.checkpoint.auth import ENV_KEY
    from hotspare.protocol.workerenv import WorkerEnv
    contract = set(WorkerEnv.variables().values()) | {ENV_KEY}
    job = {k: v for k, v in env.items() if k in JOB_VARS or k in contract}
    job["LOCAL_WORLD_SIZE"] = env["LOCAL_WORLD_SIZE"]
    return job
