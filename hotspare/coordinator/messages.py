"""A worker's messages as the coordinator reads them: one table from message type to the
signal it stands for (or None), with the bookkeeping it carries (commits, joins, checkpoints,
digests) done on the way. Decides nothing: the coordinator gives the signal to the policy."""
from __future__ import annotations

from typing import Callable

from hotspare.coordinator.execute import Executor
from hotspare.coordinator.ledger import Ledger
from hotspare.coordinator.nodes import Nodes
from hotspare.coordinator.progress import Progress
from hotspare.errors import ProtocolError
from hotspare.policy import decide as policy
from hotspare.protocol.messages import Message, make

Translator = Callable[[str, Message, float], "policy.Signal | None"]


class WorkerMessages:
    def __init__(self, nodes: Nodes, view: policy.ClusterView, ledger: Ledger, progress: Progress,
                 executor: Executor, log: Callable[[str], None], log_every: int, checkpoint_dir: str,
                 health, health_readings: Callable[..., None], stop: Callable[[str, float], None]):
        """``health_readings(readings, t, step=None)`` judges readings (the vote's, a step's
        timing) and acts on verdicts; ``stop(message, t)`` stops the job now."""
        self.nodes, self.view, self.ledger, self.progress, self.executor = nodes, view, ledger, progress, executor
        self.log, self.log_every, self.checkpoint_dir = log, log_every, checkpoint_dir
        self.health, self._health_readings, self._stop_now = health, health_readings, stop
        self._health_said: set[tuple] = set()
        # a worker's message type -> the signal it stands for (None: bookkeeping only)
        self._table: dict[str, Translator] = {
            "ready": self._ready, "commit": self._commit, "joined": self._joined, "reducing": self._reducing,
            "restored": self._restored,
            "failed": self._failed, "paused": self._paused, "handed_off": self._handed_off,
            "crash": self._crash, "checkpointed": self._checkpointed, "done": self._done,
            # fault triggers: the agent's fault plug-in acts on them (hotspare.testing.faults); the
            # worker sends them only while it is loaded, and nothing here depends on them
            "step": _no_signal, "joining": _no_signal, "transfer": _no_signal,
        }

    def types(self) -> frozenset[str]:
        """The message types this table reads."""
        return frozenset(self._table)

    def translate(self, worker: str, msg: Message, t: float) -> policy.Signal | None:
        """The signal ``msg`` from ``worker`` stands for; ProtocolError (or a KeyError, TypeError,
        ValueError: well-formed by the schema yet unusable) when it is not a worker's to send."""
        translate = self._table.get(msg["type"])
        if translate is None:
            raise ProtocolError(f"unexpected {msg['type']!r} from a worker")
        return translate(worker, msg, t)

    def _ready(self, worker: str, msg: Message, t: float) -> policy.Signal | None:
        wp = self.nodes.workers[worker]
        if self.view.phase.over:
            self.nodes.send(worker, make("release", reason=f"job {self.view.phase}"))
            return None
        return policy.WorkerReady(worker, wp.role, wp.rank if wp.role == "active" else None)

    def _reducing(self, worker: str, msg: Message, t: float) -> None:
        if msg["gen"] == self.view.generation:
            self.progress.reducing[msg["rank"]] = msg["step"]

    def _joined(self, worker: str, msg: Message, t: float) -> None:
        self.ledger.joined(msg["gen"], msg["timings"], msg["bytes"], t)
        if msg["gen"] == self.view.generation:
            self.progress.rank_joined(msg["rank"], t)

    def _restored(self, worker: str, msg: Message, t: float) -> None:
        for entry in msg["sources"][:64]:
            self.ledger.shard_restored(msg["gen"], msg["rank"], entry)
            self.log(f"RESTORED rank {msg['rank']}'s shard of step {entry.get('step')}: {entry.get('source')}"
                     + (f" from rank {entry['from_rank']}" if entry.get("from_rank") is not None else "")
                     + f" ({str(entry.get('why', ''))[:300]})")

    def _failed(self, worker: str, msg: Message, t: float) -> policy.Signal:
        health = msg.get("health")
        if isinstance(health, dict) and msg["gen"] == self.view.generation:
            said = ("vote", msg["gen"], health.get("step"))
            if said not in self._health_said:     # every rank reports the same verdict
                self._health_said.add(said)
                self.log(f"VOTE    {str(health.get('detail', ''))[:500]}")
            if self.health is not None:
                # Judge the suspects before the step failure is counted: they must not be a source.
                self._health_readings(self.health.vote_readings(health, t), t, step=health.get("step"))
        if msg["gen"] == self.view.generation:
            self.ledger.holds(msg["rank"], msg["committed"])
        return policy.StepFailed(worker, msg["rank"], msg["gen"], msg["committed"], msg["error"])

    def _paused(self, worker: str, msg: Message, t: float) -> policy.Signal:
        self.ledger.paused(t)
        if msg["gen"] == self.view.generation:
            self.ledger.holds(msg["rank"], msg["committed"])
        return policy.Paused(worker, msg["rank"], msg["gen"], msg["committed"])

    def _handed_off(self, worker: str, msg: Message, t: float) -> None:
        self.ledger.handed_off(msg["gen"], msg["bytes"], float(msg["seconds"]))

    def _crash(self, worker: str, msg: Message, t: float) -> policy.Signal:
        self.log(f"ERROR   rank {msg['rank']} ({worker}) raised at step {msg['step']}: {msg['error'][:200]}")
        return policy.Crashed(worker, msg["rank"], msg["gen"], msg["step"], msg["error"], msg["traceback"],
                              refused=msg.get("refused") is True)

    def _checkpointed(self, worker: str, msg: Message, t: float) -> policy.Signal | None:
        from hotspare.checkpoint import within    # here: the control CLI imports this module without torch
        if not within(msg["path"], [self.checkpoint_dir]):
            self.log(f"CHECKPOINT refused {worker}'s report of {msg['path']!r}: it is outside the job's "
                     f"checkpoint directory {self.checkpoint_dir}")
            return None
        self.ledger.checkpoints.append({"step": msg["step"], "path": msg["path"], "generation": msg["gen"]})
        return policy.Checkpointed(msg["step"], msg["path"])

    def _done(self, worker: str, msg: Message, t: float) -> policy.Signal:
        self.ledger.digests[msg["rank"]] = msg["digest"]
        if isinstance(msg.get("rank_digest"), str):
            self.ledger.rank_digests[msg["rank"]] = msg["rank_digest"]
        return policy.Done(worker, msg["rank"], msg["gen"], msg["step"], msg["digest"])

    def _commit(self, worker: str, msg: Message, t: float) -> None:
        if msg["gen"] != self.view.generation:
            return None             # stale: a commit of a generation already replaced
        rank, step, total = msg["rank"], msg["step"], msg.get("total")
        if self.ledger.total_steps is None and isinstance(total, int):
            self.ledger.total_steps = total
        elif isinstance(total, int) and total != self.ledger.total_steps and not self.view.phase.over:
            # Ranks that disagree on job.steps(total) would wait for each other forever at the end.
            self._stop_now(f"ranks disagree on job.steps(total): rank {rank} runs {total} steps, the job "
                           f"{self.ledger.total_steps}. Every rank must pass the same total (a value computed "
                           "from the rank or world size before init() differs on a spare)", t)
            return None
        early = [(r, d.step) for r, d in self.view.done.items() if d.step < step and d.gen == msg["gen"]]
        if early and not self.view.phase.over:
            r, s = early[0]
            self._stop_now(f"rank {r} left the training loop after step {s} while rank {rank} went on to step {step}: "
                           "an early stop (a `break` out of job.steps or job.epochs) must be decided the same on "
                           "every rank, e.g. from an all-reduced or broadcast metric", t)
            return None
        self.progress.step_committed(t)
        parts = msg.get("after_exchange")
        if isinstance(parts, list) and parts and all(isinstance(x, str) and len(x) <= 200 for x in parts[:64]):
            if rank not in self.ledger.after_exchange:
                self.log(f"NOTE    rank {rank} changed {', '.join(parts[:8])} after the gradient exchange of step "
                         f"{step}: if it is lost before its next exchange its replacement cannot get that state "
                         "(the report will say so)")
            self.ledger.changed_after_exchange(rank, step, parts[:64])
        check, fp, check_cpu = (msg.get(k) if isinstance(msg.get(k), (int, float)) else None
                                for k in ("check", "fp", "check_cpu"))
        if self.ledger.commit(rank, step, float(msg["dt"]), msg["gen"], len(self.view.members), t,
                              check, fp, check_cpu):
            self._log_recovered(msg["gen"], t)
        every = self.log_every or max(1, (self.ledger.total_steps or 20) // 20)
        if rank == 0 and (step % every == 0 or step + 1 == (self.ledger.total_steps or -1)):
            metrics = msg.get("metrics") or {}
            extra = "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
            total = f"/{self.ledger.total_steps}" if self.ledger.total_steps else ""
            self.log(f"step {step:>5}{total}  {extra}  {msg['dt'] * 1000:.0f} ms/step  gen {msg['gen']}")
        if self.health is not None and isinstance(msg.get("compute"), (int, float)):
            self._health_readings(self.health.step_timing(rank, float(msg["compute"]),
                                                          float(msg.get("comm", 0.0)), t), t)
        return None

    def _log_recovered(self, gen: int, t: float) -> None:
        for m in self.ledger.migrations:
            if m.generation == gen and m.first_commit_at == t:
                self.log(f"MIGRATED rank {m.rank} off {m.device} -> {m.spare}: state of step "
                         f"{m.target_step} ({m.bytes_transferred / 1e6:.1f} MB in {m.transfer_s * 1000:.0f} ms) "
                         f"handed over directly; downtime {m.first_commit_at - m.signal_at:.2f} s from the "
                         f"signal to the next committed step, lost steps 0")
        for f in self.ledger.failures:
            if f.generation == gen and f.first_commit_at == t:
                src = "the checkpoint" if f.recovery_path == "checkpoint" else f"rank {f.source_rank}"
                shrunk = f.replacement is None and self.view.placement is not None
                to = "its virtual ranks on the survivors" if shrunk else self.executor.where(f.replacement or f.worker)
                self.log(f"RESUMED rank {f.rank} -> {to}: state of "
                         f"step {f.target_step} ({f.bytes_transferred / 1e6:.1f} MB in "
                         f"{f.transfer_s * 1000:.0f} ms) from {src}; first step committed; downtime "
                         f"{f.first_commit_at - f.start:.2f} s, lost steps {f.lost_steps}")


def _no_signal(worker: str, msg: Message, t: float) -> None:
    return None
