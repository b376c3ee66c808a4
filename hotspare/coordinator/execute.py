"""The coordinator's executor: it carries out the policy's actions (commands to node agents and
workers), tells the ledger what they did, and logs them. It decides nothing."""
from __future__ import annotations

import signal
import time
from typing import Any, Callable

from hotspare.coordinator.checkpoints import CheckpointVetter
from hotspare.coordinator.ledger import Ledger
from hotspare.coordinator.nodes import Nodes
from hotspare.coordinator.progress import Progress
from hotspare.policy import decide as policy
from hotspare.protocol.messages import make

FENCE_STACKS_S = 0.2    # a fenced worker's moment to write its stacks (SIGUSR1) before the SIGKILL


def _fmt_ranks(ranks) -> str:
    return ",".join(map(str, ranks))


class Executor:
    def __init__(self, nodes: Nodes, view: policy.ClusterView, ledger: Ledger, progress: Progress,
                 vetter: CheckpointVetter, log: Callable[[str], None], checkpoint_dir: str,
                 join_timeout: float, health=None):
        self.nodes, self.view, self.ledger, self.progress, self.vetter = nodes, view, ledger, progress, vetter
        self.log, self.checkpoint_dir, self.join_timeout, self.health = log, checkpoint_dir, join_timeout, health
        self.unplaced = 0                       # spares wanted but no usable device was free
        self.exit_code: int | None = None       # set when the job is released or stopped
        self.preempt_code: int | None = None    # a stop signal's exit code, once one arrived
        self._table: dict[type, Callable[[Any, str, float], None]] = {
            policy.FormGeneration: self._form,
            policy.AbortGeneration: self._abort,
            policy.Fence: self._fence,
            policy.CheckpointNow: self._checkpoint_now,
            policy.StartSpares: self._start_spares,
            policy.Pause: self._pause,
            policy.Regrow: self._regrow,
            policy.Cordon: self._cordon,
            policy.Release: self._release,
            policy.Stop: self._stop,
        }

    def execute(self, action: policy.Action, reason: str = "", t: float | None = None) -> None:
        t = time.time() if t is None else t
        self._table[type(action)](action, reason, t)

    def where(self, worker: str) -> str:
        """A worker's name, and its node's when the job spans several."""
        info = self.nodes.workers.get(worker)
        return f"{worker} on {info.node}" if info is not None and len(self.nodes.nodes) > 1 else worker

    def spawn_spares(self, count: int) -> int:
        """Start spares; one that no usable device can take waits (counted as starting) until a
        device returns to service (``place_waiting``)."""
        started = 0
        for _ in range(count):
            if self.nodes.spawn("spare") is None:
                self.unplaced += 1
                self.log("CAPACITY no usable device is free for a new spare (devices out of service: "
                         "see `hotspare health`); it starts when a device returns to the pool")
            else:
                started += 1
        return started

    def place_waiting(self) -> None:
        """Start the spares that waited for a usable device, as devices return to the pool."""
        while self.unplaced and self.nodes.free_devices():
            self.unplaced -= 1
            if self.nodes.spawn("spare") is None:
                self.unplaced += 1
                break
            self.log("CAPACITY a device is back in the pool: starting the spare that waited for it")

    # ------------------------------------------------------------------ one method per action
    def _form(self, a: policy.FormGeneration, reason: str, t: float) -> None:
        now = time.time()
        if a.handoff_from is not None:
            self.log(f"MIGRATE generation {a.gen}: {reason}")
        elif a.regrow:
            self.log(f"REGROW  generation {a.gen}: {reason}")
        elif a.placement is not None and a.before is not None:
            self.log(f"SHRINK  generation {a.gen}: {reason}")
        elif a.gen > 1:
            self.log(f"RECOVER generation {a.gen}: {reason}")
        else:
            self.log(f"START   generation 1: ranks 0-{len(a.members) - 1} on workers "
                     f"{_fmt_ranks(a.members.values())}; {reason}")
        self.ledger.formed(a, reason, now)
        self.progress.formed(now, a.restore)
        self.vetter.reset()
        extra: dict[str, Any] = {}
        placement = a.placement if a.placement is not None else self.view.placement
        if placement is not None:       # an elastic job: which virtual ranks each rank runs
            extra["placement"] = list(placement)
            if a.before is not None:
                extra["before"] = list(a.before)
        if a.handoff_from is not None:
            # The old worker sends its own state to the spare (a 2-member group), then exits.
            extra["join_timeout"] = max(30.0, 4 * self.join_timeout)
            rank = next(r for r, w in a.replacements.items())
            self.nodes.send(a.handoff_from, make("handoff", gen=a.gen, rank=rank,
                                                 handoff=f"handoff{a.gen}/", **extra))
        for rank, worker in a.members.items():
            self.nodes.workers[worker].rank = rank
            if self.health is not None:
                self.health.assign(rank, self.nodes.workers[worker].device, worker)
            handoff = ({"handoff": f"handoff{a.gen}/"} if a.handoff_from is not None
                       and a.replacements.get(rank) == worker else {})
            # "moved": state moves to some rank in this generation (every member is told alike:
            # their first vote after it checks the transfer, and a vote is a collective)
            moved = bool(a.receivers or a.restore or a.replacements)
            self.nodes.send(worker, make("generation", gen=a.gen, rank=rank, world=len(a.members),
                                         prefix=f"gen{a.gen}/", target=a.target, source=a.source,
                                         receivers=list(a.receivers), restore=a.restore, moved=moved,
                                         **handoff, **extra))

    def _abort(self, a: policy.AbortGeneration, reason: str, t: float) -> None:
        for r in a.ranks:
            self.nodes.send(self.view.members[r], make("abort", gen=a.gen, reason=reason))

    def _fence(self, a: policy.Fence, reason: str, t: float) -> None:
        workers = [self.view.members[r] for r in a.ranks]
        for w in workers:     # where was it? every thread's stack goes to its stderr first
            self.nodes.kill(w, signal.SIGUSR1, group=False)
        time.sleep(FENCE_STACKS_S)
        for r, worker in zip(a.ranks, workers):
            self.ledger.fenced(worker, t, a.cause, a.rule, a.reason)
            self.log(f"FENCE   rank {r} ({worker}): {a.reason}; SIGKILL to its process group "
                     "(its threads' stacks are above, from faulthandler)")
            self.nodes.kill(worker, signal.SIGKILL, group=True)

    def _checkpoint_now(self, a: policy.CheckpointNow, reason: str, t: float) -> None:
        self.log(f"STOPPING {a.reason} Rank {a.rank} writes a last checkpoint to {self.checkpoint_dir}")
        self.nodes.send(self.view.members[a.rank], make("checkpoint_now"))

    def _start_spares(self, a: policy.StartSpares, reason: str, t: float) -> None:
        self.spawn_spares(a.count)

    def _pause(self, a: policy.Pause, reason: str, t: float) -> None:
        self.ledger.migration_started(a, self.view.members[a.rank], t)
        self.log(f"MIGRATE {a.reason}")
        for w in self.view.members.values():
            self.nodes.send(w, make("pause", gen=a.gen, reason=a.reason))

    def _regrow(self, a: policy.Regrow, reason: str, t: float) -> None:
        self.log(f"REGROW  {a.reason}")
        for w in self.view.members.values():
            self.nodes.send(w, make("pause", gen=a.gen, reason=a.reason))

    def _cordon(self, a: policy.Cordon, reason: str, t: float) -> None:
        if self.health is not None:
            self.health.cordon(a.device, a.reason, a.rule, t, retire=a.retire)

    def _release(self, a: policy.Release, reason: str, t: float) -> None:
        self.ledger.finished()
        self._release_all(a.reason)
        self.exit_code = 0

    def _stop(self, a: policy.Stop, reason: str, t: float) -> None:
        self.ledger.stopped(a.message, preempted=self.preempt_code is not None)
        self.log(f"STOP    {a.message}")
        self._release_all("job stopped")
        for w in self.nodes.alive():
            self.nodes.kill(w)
        self.exit_code = self.preempt_code if self.preempt_code is not None else a.code

    def _release_all(self, reason: str) -> None:
        for w in self.nodes.alive():
            if w not in self.view.ready_workers and self.view.rank_of(w) is None:
                self.nodes.kill(w)      # a spare still booting: nothing to wait for
            else:
                self.nodes.send(w, make("release", reason=reason))
