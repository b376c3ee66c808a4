"""Stopping a job on SIGTERM or SIGINT to its launcher (preemption): every rank leaves its
step, the lowest survivor writes a last checkpoint from memory (as when capacity runs out),
then the job stops with the signal's exit status; at most ``timeout`` seconds, after which it
stops without one. The coordinator feeds it the signal (``start``) and its ticks (``progress``);
what it decides goes through the coordinator's ``act`` (the same actions the pure policy
returns) or ``stop``."""
from __future__ import annotations

from typing import Callable

from hotspare.policy import decide as policy
from hotspare.policy.phase import JobPhase


class Preemption:
    def __init__(self, view: policy.ClusterView, timeout: float, checkpoint_dir: str,
                 act: Callable[[tuple, str, float], None], stop: Callable[[str, float], None],
                 log: Callable[[str], None]):
        self.view, self.timeout, self.checkpoint_dir = view, timeout, checkpoint_dir
        self._act, self._stop, self.log = act, stop, log
        self.signal: str | None = None       # the signal received, once it was
        self.code: int | None = None          # the exit status it asks for
        self.deadline = 0.0
        self._asked = False                   # a survivor was asked for the last checkpoint

    @property
    def active(self) -> bool:
        return self.signal is not None

    def start(self, signame: str, code: int, t: float) -> None:
        """``signame`` reached the launcher at ``t`` (the job is not over, and no signal came before)."""
        view = self.view
        self.signal, self.code, self.deadline = signame, code, t + self.timeout
        what = "interrupted by the user" if signame == "SIGINT" else "terminated"
        reason = f"{what} ({signame}): stopping after a last checkpoint."
        self.log(f"STOPPING {signame} received: every rank leaves its step; the lowest survivor writes a last "
                 f"checkpoint to {self.checkpoint_dir} (at most {self.timeout:.0f} s)")
        live = [r for r in view.members if r not in view.lost]
        if not view.phase.active or not live:
            self._stop(f"{what} ({signame}) before any rank held state to checkpoint.", t)
            return
        view.stopping = reason
        if view.phase is JobPhase.RUNNING:
            self._act((policy.AbortGeneration(view.generation, tuple(sorted(live))),), reason, t)
        self.progress(t)

    def progress(self, now: float) -> bool:
        """Once every survivor has reported, ask the lowest to checkpoint; past the deadline,
        stop without one. True when the job was stopped."""
        view = self.view
        if now >= self.deadline:
            self._stop(f"{view.stopping} No checkpoint was written within {self.timeout:.0f} s.", now)
            return True
        live = set(view.members) - view.lost
        if view.phase is JobPhase.RECOVERING and live and live <= set(view.reports) and not self._asked:
            self._asked = True
            self._act((policy.CheckpointNow(min(live), view.stopping),), view.stopping, now)
        return False
