"""What the coordinator service checks of a job before it queues or starts it, on its own host.

`hotspare run` checks its paths where it runs (``hotspare.config.preflight``): the script exists,
the checkpoint directory is made and written. The service is not where a job runs: a client
that could make it create directories, or learn whether a path exists on its host, would use
it as a probe. So here paths are only checked for their form (absolute: the same on every
host); the script and the checkpoint directory are met where the job runs (a missing script
stops the job with its workers' exit, checkpoints are written by the workers, which make the
directory). The two files the service must read for a job, a --resume checkpoint and a
--health-rules file, are read bounded, and a refusal says the same whatever the reason, so it
tells nothing of the file. The checkpoint key is the service's own (`--checkpoint-key` is the
service's flag, ``jobargs.OWNED``).
"""
from __future__ import annotations

import dataclasses
import os
import stat

from hotspare.config.preflight import Preflight, injection
from hotspare.config import RunConfig
from hotspare.errors import ConfigError

MAX_RULES_BYTES = 1 << 20


def service_preflight(cfg: RunConfig) -> Preflight:
    """The job's checks on the service's host; what they resolved (as ``preflight``'s)."""
    from hotspare.checkpoint import CheckpointError, key_path, load_key, newest_valid, verify, within
    c = cfg.checkpoint
    for flag, path in (("the script", cfg.script), ("--checkpoint-dir", c.checkpoint_dir), ("--resume", c.resume),
                       ("--health-rules", cfg.health.health_rules)):
        if path and not os.path.isabs(path):
            raise ConfigError(f"{flag} {path[:200]!r}: give an absolute path, the same on every host "
                              "(`hotspare submit` makes the script's absolute)")
    faults = [injection().parse(spec, world_size=cfg.launch.nproc) for spec in cfg.faults.inject]
    key_file = key_path(None)           # the service's own key
    for flag, where in (("--checkpoint-dir", c.checkpoint_dir), ("--resume", c.resume)):
        if where and within(key_file, [where]):
            raise ConfigError(f"{flag} {where}: the service's checkpoint key lies inside it; choose another "
                              "directory")
    try:
        key = load_key(key_file)
    except ConfigError:
        if c.checkpoint_dir or c.resume:
            raise ConfigError("the service's checkpoint key cannot be used: its operator must fix it "
                              "($HOTSPARE_CHECKPOINT_KEY where `hotspare coordinator` runs)") from None
        key = None
    pre = Preflight(faults=faults, key_file=key_file, key=key, rules=_rules(cfg.health.health_rules))
    if not c.resume:
        return pre
    unusable = ConfigError(f"--resume {c.resume[:200]}: no checkpoint of this service's jobs that verifies there "
                           "(name the directory a job wrote its checkpoints to, as the service's host sees it)")
    try:
        if os.path.isfile(os.path.join(c.resume, "hotspare.json")):
            return dataclasses.replace(pre, resume_path=verify(c.resume, key).path)
        if not os.path.isdir(c.resume):
            raise unusable
        info, refused = newest_valid(c.resume, key)
    except (CheckpointError, OSError):
        raise unusable from None
    if info is None:
        raise unusable
    fallbacks = [{"refused": path, "reason": reason, "used": info.path, "step": info.step} for path, reason in refused]
    return dataclasses.replace(pre, resume_path=info.path, fallbacks=fallbacks)


def _rules(path: str | None):
    """The job's --health-rules, read bounded; one refusal whatever is wrong with the file."""
    if not path:
        return None
    from hotspare.health.rulefile import DEFAULT_SOURCE, default_rules_text, parse_rules
    unusable = ConfigError(f"--health-rules {path[:200]}: not a rules file the service can use (a readable "
                           f"regular file of at most {MAX_RULES_BYTES >> 20} MiB of valid rules on the service's "
                           "host; check it with `hotspare run --health-rules FILE` there)")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        raise unusable from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_RULES_BYTES:
            raise unusable
        text = os.read(fd, MAX_RULES_BYTES + 1).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        raise unusable from None
    finally:
        os.close(fd)
    try:
        return parse_rules([(default_rules_text(), DEFAULT_SOURCE), (text, path)])
    except ConfigError:
        raise unusable from None
