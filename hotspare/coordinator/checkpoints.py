"""Checkpoint vetting before a restore: the coordinator orders one only from a checkpoint that
verifies (MAC, every file's digest) and has not failed a restore already."""
from __future__ import annotations

import os
from typing import Callable

from hotspare.coordinator.ledger import Ledger
from hotspare.errors import ConfigError
from hotspare.policy import decide as policy
from hotspare.policy.phase import JobPhase


class CheckpointVetter:
    def __init__(self, key: bytes | None, ledger: Ledger, log: Callable[[str], None]):
        self.key, self.ledger, self.log = key, ledger, log
        self.failed: set[str] = set()          # checkpoints the workers could not restore
        self._vetted: set[str] = set()         # verified for the restore being decided

    def reset(self) -> None:
        """A generation formed: the next restore is vetted afresh."""
        self._vetted = set()

    def restore_failed(self, path: str) -> bool:
        """The workers could not restore ``path``; True the first time it is said."""
        if path in self.failed:
            return False
        self.failed.add(path)
        return True

    def vet(self, v: policy.ClusterView) -> str | None:
        """Before the policy may order a restore (generation 1 of --resume, or every copy lost),
        the checkpoint it would use must verify and not have failed a restore already; else the
        newest older one that does takes its place in ``v``, said in the log and the report.
        With none left the view holds no checkpoint, and the policy stops the job instead of
        restoring forever. Returns a message when the job must stop now (--resume, nothing usable)."""
        if v.phase is JobPhase.STARTING and v.resume:
            path = v.resume
        elif v.phase is JobPhase.RECOVERING and v.checkpoint is not None and no_copy_left(v):
            path = v.checkpoint.path
        else:
            return None
        if path in self._vetted:
            return None
        from hotspare.checkpoint import CheckpointError, newest_valid, verify
        try:
            if path in self.failed:
                raise CheckpointError("the workers could not restore it")
            verify(path, self.key)
            self._vetted.add(path)
            return None
        except (CheckpointError, ConfigError) as e:    # ConfigError: the key file itself
            why = str(e)
        root = os.path.dirname(path.rstrip(os.sep))
        try:
            info, refused = newest_valid(root, self.key)
        except ConfigError as e:
            info, refused = None, [(root, str(e))]
        if info is not None and info.path in self.failed:
            info = None
        self.ledger.checkpoint_fallbacks.append({"refused": path, "reason": why, "used": info and info.path,
                                                 "step": info and info.step})
        if info is None:
            self.log(f"CHECKPOINT refused {path}: {why}; no other checkpoint in {root} verifies"
                     + "".join(f"; {p}: {r}" for p, r in refused if p != path))
            if v.phase is JobPhase.STARTING:
                return f"--resume: no usable checkpoint ({why})"
            v.checkpoint = None
            return None
        self.log(f"CHECKPOINT refused {path}: {why}; falling back to the older checkpoint of step {info.step} "
                 f"({info.path})")
        self._vetted.add(info.path)
        if v.phase is JobPhase.STARTING:
            v.resume = info.path
        else:
            v.checkpoint = policy.Checkpointed(info.step, info.path)
        return None


def no_copy_left(v: policy.ClusterView) -> bool:
    """Every survivor has reported and none holds the state (as ``plan_recovery`` judges: a
    survivor more than a step behind the job is no copy): the next plan is a restore."""
    if set(v.members) - v.lost - set(v.reports):
        return False
    return not any(s >= v.job_step - 1 for s in v.reports.values())
