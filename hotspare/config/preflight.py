"""What ``hotspare run`` checks on this host before it starts anything.

``RunConfig`` checks itself (ranges, flags that need each other); what needs the host is
checked here: this node's process slots, CUDA for ``--backend nccl``, the script, the
checkpoint directory and key, a ``--resume`` checkpoint (verified: MAC and file digests,
nothing deserialised), a rules file, the ``--inject`` specs. ``preflight`` returns what it
resolved on the way, so nothing is looked up twice; every refusal is a ConfigError naming the
flag.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

from hotspare.config import RunConfig
from hotspare.errors import ConfigError


def injection():
    """The fault-injection module (its grammar and parser); the one place that names it."""
    from hotspare.testing.faults import grammar
    return grammar


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preflight:
    """What the checks resolved."""
    faults: list                        # the parsed --inject specs
    key_file: str                       # the checkpoint key file in use (absolute)
    key: bytes | None                   # its key; None when unusable and no checkpoint is asked for
    resume_path: str | None = None      # the checkpoint --resume starts from
    fallbacks: list[dict[str, Any]] = dataclasses.field(default_factory=list)   # newer ones refused
    rules: Any = None                   # the loaded --health-rules, if given


def node_slots() -> int:
    """How many workers + spares this node holds without --oversubscribe: one per GPU, or on a
    CPU-only node four per core (they share the cores, as the test suite's 4 + 1 on 2 cores do)."""
    try:
        import torch
        gpus = torch.cuda.device_count()
    except Exception:   # noqa: BLE001 -- no usable CUDA: a CPU node
        gpus = 0
    return gpus or 4 * (os.cpu_count() or 1)


def preflight(cfg: RunConfig) -> Preflight:
    nproc, spares = cfg.launch.nproc, cfg.capacity.spares
    slots = node_slots()
    if nproc + spares > slots and not cfg.launch.oversubscribe and cfg.local_nodes:
        raise ConfigError(f"--nproc {nproc} + --spares {spares} is more than this node's {slots} "
                          "process slots (one per GPU, or 4 per CPU core): lower them, or pass --oversubscribe "
                          "if you mean it")
    if cfg.launch.backend == "nccl":
        check_nccl()
    checkpoint = _checkpoints(cfg)
    rules = None
    if cfg.health.health_rules:
        from hotspare.health.rulefile import load_rules
        rules = load_rules(cfg.health.health_rules)     # refuse a bad rules file before starting
    if not os.path.isfile(cfg.script):
        raise ConfigError(f"script {cfg.script!r} not found: give the path of a training script, "
                          "e.g. hotspare run --nproc 4 -- examples/gpt_stdlib.py")
    faults = [injection().parse(spec, world_size=nproc) for spec in cfg.faults.inject]
    return dataclasses.replace(checkpoint, faults=faults, rules=rules)


def check_nccl() -> None:
    """--backend nccl needs CUDA here: refused at start, not when the first group forms."""
    try:
        import torch
        available = torch.cuda.is_available()
    except Exception:   # noqa: BLE001 -- a broken CUDA install is no CUDA
        available = False
    if not available:
        raise ConfigError("--backend nccl needs CUDA, and torch.cuda.is_available() is False on this host: "
                          "use --backend gloo (the default) here")


def _checkpoints(cfg: RunConfig) -> Preflight:
    """The checkpoint directory must be usable and the key safe before anything starts; a
    --resume checkpoint is verified and, if the newest does not verify, the newest older one
    that does is taken and named."""
    from hotspare.checkpoint import CheckpointError, key_path, load_key, newest_valid, verify, within
    c = cfg.checkpoint
    if c.checkpoint_dir:
        usable_dir(c.checkpoint_dir)
    key_file = key_path(c.checkpoint_key)
    for flag, where in (("--checkpoint-dir", c.checkpoint_dir), ("--resume", c.resume)):
        if where and within(key_file, [where]):
            raise ConfigError(f"the checkpoint key {key_file} lies inside {flag} {where}: whoever can write "
                              "checkpoints there could read it; keep it elsewhere (--checkpoint-key FILE)")
    try:
        key = load_key(key_file)   # also signs the last checkpoint of a job that stops for capacity
    except ConfigError:
        if c.checkpoint_dir or c.resume:
            raise
        key = None                 # no checkpoints asked for: a job without a usable key still runs
    done = Preflight(faults=[], key_file=key_file, key=key)
    if not c.resume:
        return done
    try:
        if os.path.isfile(os.path.join(c.resume, "hotspare.json")):
            return dataclasses.replace(done, resume_path=verify(c.resume, key).path)   # that one, or an error
        if not os.path.isdir(c.resume):
            raise CheckpointError("the path does not exist; pass the directory the job wrote checkpoints to")
        info, refused = newest_valid(c.resume, key)
    except CheckpointError as e:
        raise ConfigError(f"--resume {c.resume}: {e}") from None
    if info is None:
        why = "; ".join(reason for _, reason in refused) or "it holds no complete checkpoint (step-<N> folder)"
        raise ConfigError(f"--resume {c.resume}: no valid checkpoint: {why}")
    fallbacks = [{"refused": path, "reason": reason, "used": info.path, "step": info.step} for path, reason in refused]
    return dataclasses.replace(done, resume_path=info.path, fallbacks=fallbacks)


def usable_dir(path: str) -> None:
    """Refuse a --checkpoint-dir that is a file, cannot be made, or cannot be written."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--checkpoint-dir {path} is not a directory: name a directory (it is made if "
                          "missing)")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".hotspare-probe-"):
            pass
    except OSError as e:
        raise ConfigError(f"--checkpoint-dir {path} cannot be written ({e.strerror or e}): choose a writable "
                          "directory") from None
