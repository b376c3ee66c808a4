"""What happened, measured: commits, failures and recoveries, and the JSON report.

The ledger only records; it decides nothing. It is the one writer of failure and migration
records: the coordinator tells it what happened (a member lost, a generation formed, a rank
joined...) and it keeps the records' times and outcomes. Times are wall-clock seconds of the launcher's
clock (workers on the same host share it), so a fault's downtime runs from the moment the fault
was injected (or detected, for faults nobody injected) to the moment every rank of the new
generation committed its first step.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from hotspare.policy.actions import FormGeneration, Pause
from hotspare.policy.signals import FailureCause, exit_cause, signal_name


@dataclass
class FailureRecord:
    cause: FailureCause
    rank: int
    worker: str
    step: int | None                  # the step in flight on that rank
    detected_at: float
    fault_at: float | None = None     # known for injected faults
    error: str | None = None
    spare_was_warm: bool = False      # a warm spare was ready when the fault was detected
    reason: str = ""                  # the coordinator's decision, in words
    recovery_path: str | None = None  # "memory" (warm spare, no lost step) / "checkpoint" / "stopped"
    generation: int | None = None     # the generation that resumed training
    replacement: str | None = None
    source_rank: int | None = None
    target_step: int | None = None
    lost_steps: int | None = None
    bytes_transferred: int = 0
    decided_at: float | None = None
    joined_at: float | None = None
    rebuild_s: float = 0.0
    transfer_s: float = 0.0
    first_commit_at: float | None = None
    exit_code: int | None = None      # KILLED / EXITED: the process's exit status (negative: its signal)
    rule: str = ""                    # HEALTH: the rule that fenced it
    # a sharded job: where the rank's shard came from, and why ({"source", "from_rank", "why", ...})
    shard_source: dict[str, Any] | None = None

    @property
    def start(self) -> float:
        return self.fault_at if self.fault_at is not None else self.detected_at

    @property
    def kind(self) -> str:
        """The report's name for the cause: "SIGKILL", "exit 7", "hang", "health:<rule>"..."""
        if self.cause is FailureCause.KILLED and self.exit_code is not None:
            return signal_name(self.exit_code)
        if self.cause is FailureCause.EXITED and self.exit_code is not None:
            return f"exit {self.exit_code}"
        if self.cause is FailureCause.HEALTH:
            return f"health:{self.rule}"
        return self.cause.value

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if not k.endswith("_at")}
        d["cause"], d["kind"] = self.cause.value, self.kind
        d["detection_latency_s"] = None if self.fault_at is None else round(self.detected_at - self.fault_at, 6)
        d["downtime_s"] = None if self.first_commit_at is None else round(self.first_commit_at - self.start, 6)
        d["phases_s"] = self.phases()
        return d

    def phases(self) -> dict[str, float | None]:
        def span(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(b - a, 6)
        return {
            "detect": span(self.fault_at, self.detected_at),
            "decide": span(self.detected_at, self.decided_at),
            "rebuild_groups": round(self.rebuild_s, 6),
            "transfer_state": round(self.transfer_s, 6),
            "first_committed_step": span(self.joined_at, self.first_commit_at),
        }


@dataclass
class MigrationRecord:
    """A live migration: a rank moved off a degrading device at a step boundary."""
    rank: int
    device: str
    rule: str
    reason: str
    signal_at: float                  # when the verdict was acted on (the pause was asked)
    spare: str
    worker: str                       # the worker that left
    fault_at: float | None = None     # injected faults: when the device started to degrade
    stopped_at: float | None = None   # the first rank left the generation: training stands still
    paused_at: float | None = None    # every rank stopped at the boundary
    generation: int | None = None
    target_step: int | None = None
    lost_steps: int | None = None
    bytes_transferred: int = 0
    transfer_s: float = 0.0
    rebuild_s: float = 0.0
    first_commit_at: float | None = None
    outcome: str = "in flight"        # "migrated" / "superseded by a failure"

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if not k.endswith("_at")}
        d["downtime_s"] = (None if self.first_commit_at is None
                           else round(self.first_commit_at - self.signal_at, 6))
        d["pause_s"] = None if self.paused_at is None else round(self.paused_at - self.signal_at, 6)
        # Training goes on until the agreed boundary (the next vote step); it stands still only
        # from the first rank leaving to the first step committed with the spare.
        d["stall_s"] = (None if self.first_commit_at is None or self.stopped_at is None
                        else round(self.first_commit_at - self.stopped_at, 6))
        d["detection_latency_s"] = None if self.fault_at is None else round(self.signal_at - self.fault_at, 6)
        return d


@dataclass
class Ledger:
    settings: dict[str, Any]
    started: float = field(default_factory=time.time)
    commits: dict[int, int] = field(default_factory=dict)          # rank -> last committed step
    seen: set[tuple[int, int]] = field(default_factory=set)        # (rank, step) committed
    repeated: set[int] = field(default_factory=set)                # steps committed twice by a rank
    step_times: list[float] = field(default_factory=list)
    check_times: list[float] = field(default_factory=list)         # rank 0's health checks per step
    check_cpu_times: list[float] = field(default_factory=list)     # ... their CPU time
    fingerprint_times: list[float] = field(default_factory=list)   # ... of which the fingerprint
    failures: list[FailureRecord] = field(default_factory=list)
    open: list[FailureRecord] = field(default_factory=list)        # awaiting their first commit
    digests: dict[int, str] = field(default_factory=dict)        # rank -> its replicated state's digest
    rank_digests: dict[int, str] = field(default_factory=dict)   # rank -> its per-rank state's digest
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    checkpoint_fallbacks: list[dict[str, Any]] = field(default_factory=list)   # {"refused", "reason", "used", "step"}
    shard_restores: list[dict[str, Any]] = field(default_factory=list)   # a sharded job: each restored shard's source
    migrations: list[MigrationRecord] = field(default_factory=list)
    health_events: list[dict[str, Any]] = field(default_factory=list)
    devices: list[dict[str, Any]] = field(default_factory=list)    # final device states
    nodes: dict[str, Any] = field(default_factory=dict)            # node -> its slots and workers
    total_steps: int | None = None
    outcome: str = "running"
    message: str = ""
    fault_at: dict[str, float] = field(default_factory=dict)      # worker -> when a fault was injected into it
    fences: dict[str, tuple[float, FailureCause, str, str]] = field(default_factory=dict)  # worker -> (t, cause, rule, why)
    # rank -> {"parts", "first_step", "last_step", "steps" (reports)}: the rank's script changed its per-rank state
    # after the step's gradient exchange (runtime/rankstate.py); a replacement of that rank cannot get it
    after_exchange: dict[int, dict[str, Any]] = field(default_factory=dict)

    # ------------------------------------------------------------------ failures and migrations
    def fault_injected(self, worker: str, t: float) -> None:
        """A fault was injected into ``worker`` at ``t`` (the fault plug-in says so): its
        failure's downtime and detection latency run from then."""
        self.fault_at[worker] = t

    def fenced(self, worker: str, t: float, cause: FailureCause, rule: str = "", why: str = "") -> None:
        """``worker`` was fenced at ``t``: its failure is detected then, for ``cause`` (``why``:
        the detector's words, the record's ``error`` when the worker reported none)."""
        self.fences[worker] = (t, cause, rule, why)

    def member_lost(self, rank: int, worker: str, code: int, t: float, last_step: int | None,
                    error: str | None, node_lost: bool, spare_was_warm: bool) -> FailureRecord:
        """A member of the current generation is gone (exit status ``code``); its record, open
        until its replacement commits. ``error``: what its step raised, if it reported one."""
        fence = self.fences.get(worker)
        rule = ""
        if fence is not None:
            t, cause, rule, *why = fence            # detected when the detector fired (a journal of
            why = why[0] if why else ""              # an older service holds no reason)
            error = error if error is not None else (f"fenced: {why}" if why else None)
        elif error is not None:
            cause = FailureCause.EXCEPTION
        elif node_lost:
            cause = FailureCause.NODE_LOST
        else:
            cause = exit_cause(code)
        # The step it was in: its own reports say (None: it never ran one), or, as ranks > 0
        # report commits in batches, the step after the job's newest commit (rank 0 reports each
        # at once), if that is later.
        step = None if last_step is None else max(last_step, self.max_committed() + 1)
        rec = FailureRecord(cause=cause, rank=rank, worker=worker, step=step, detected_at=t,
                            fault_at=self.fault_at.get(worker), error=error, spare_was_warm=spare_was_warm,
                            exit_code=code, rule=rule)
        self.failures.append(rec)
        self.open.append(rec)
        return rec

    def formed(self, a: FormGeneration, reason: str, now: float) -> None:
        """Generation ``a.gen`` formed: the open failures (and a pending migration) are
        resolved by it; a re-form after gen 1 with no failure open was a transient collective
        failure, recorded as one."""
        if a.gen > 1 and a.handoff_from is None and not a.regrow:
            if not self.open:   # a collective failed but nobody died: a transient fault
                rec = FailureRecord(cause=FailureCause.COLLECTIVE, rank=-1, worker="", step=a.target + 1,
                                    detected_at=now)
                self.failures.append(rec)
                self.open.append(rec)
            lost_steps = max(0, self.max_committed() - a.target)
            for f in self.open:
                # a restore resolves every open failure anew: a sharded job that found a lost shard
                # in no survivor's memory goes back to its checkpoint after a generation formed
                if f.generation is None or a.restore:
                    f.generation, f.reason, f.decided_at = a.gen, reason, now
                    f.recovery_path = "checkpoint" if a.restore else "memory"
                    f.lost_steps = lost_steps
                    f.replacement = a.replacements.get(f.rank) or f.replacement
                    f.source_rank, f.target_step = a.source, a.target
        for m in self.migrations:
            if m.generation is None:
                if a.handoff_from == m.worker:
                    m.generation, m.target_step, m.lost_steps = a.gen, a.target, 0
                else:
                    m.generation, m.outcome = a.gen, "superseded by a failure"

    def migration_started(self, action: Pause, worker: str, t: float) -> None:
        self.migrations.append(MigrationRecord(action.rank, action.device, action.rule, action.reason, t,
                                               action.spare, worker, fault_at=self.fault_at.get(worker)))

    def paused(self, t: float) -> None:
        """A rank left its generation for the pending migration."""
        m = next((m for m in reversed(self.migrations) if m.generation is None), None)
        if m is not None:
            m.stopped_at = min(m.stopped_at or t, t)
            m.paused_at = max(m.paused_at or 0.0, t)

    def handed_off(self, gen: int, nbytes: int, seconds: float) -> None:
        for m in self.migrations:
            if m.generation == gen:
                m.bytes_transferred, m.transfer_s = nbytes, seconds

    def joined(self, gen: int, timings: dict[str, Any], nbytes: int, t: float) -> None:
        """A rank joined generation ``gen`` (its group built in ``rebuild`` s, its state moved
        in ``transfer`` s)."""
        rebuild, transfer = float(timings.get("rebuild", 0.0)), float(timings.get("transfer", 0.0))
        for m in self.migrations:
            if m.generation == gen:
                m.rebuild_s = max(m.rebuild_s, rebuild)
        for f in self.open:
            if f.generation == gen:
                f.joined_at = max(f.joined_at or 0.0, t)
                f.rebuild_s = max(f.rebuild_s, rebuild)
                f.transfer_s = max(f.transfer_s, transfer)
                f.bytes_transferred = max(f.bytes_transferred, nbytes)

    def shard_restored(self, gen: int, rank: int, entry: dict[str, Any]) -> None:
        """Rank ``rank``'s shard in generation ``gen`` came from ``entry["source"]`` (a sharded job)."""
        rec = {**entry, "rank": rank, "generation": gen}
        self.shard_restores.append(rec)
        for f in self.failures:
            if f.rank == rank and f.generation == gen:
                f.shard_source = rec

    def finished(self) -> None:
        self.outcome = "finished"
        for m in self.migrations:
            if m.outcome == "in flight":
                m.outcome = "not needed: training finished first"

    def stopped(self, message: str, preempted: bool) -> None:
        self.outcome, self.message = ("preempted" if preempted else "stopped"), message
        for f in self.open:     # never resumed: a generation that formed but never committed did not recover it
            f.recovery_path = "stopped"

    # ------------------------------------------------------------------ commits

    def commit(self, rank: int, step: int, dt: float, gen: int, world: int, now: float,
               check: float | None = None, fp: float | None = None, check_cpu: float | None = None) -> bool:
        """Record a commit; True when it completes the first step of a recovered generation."""
        if (rank, step) in self.seen:
            self.repeated.add(step)
        self.seen.add((rank, step))
        self.commits[rank] = max(self.commits.get(rank, -1), step)
        if rank == 0:
            self.step_times.append(dt)
            if check is not None:
                self.check_times.append(check)
            if check_cpu is not None:
                self.check_cpu_times.append(check_cpu)
            if fp is not None:
                self.fingerprint_times.append(fp)
        closing = [f for f in self.open if f.generation == gen and f.target_step is not None
                   and step == f.target_step + 1]
        moving = [m for m in self.migrations if m.generation == gen and m.first_commit_at is None
                  and m.target_step is not None and step == m.target_step + 1]
        if (closing or moving) and all(self.commits.get(r, -1) >= step for r in range(world)):
            for f in closing:
                f.first_commit_at = now
                self.open.remove(f)
            for m in moving:
                m.first_commit_at, m.outcome = now, "migrated"
            return True
        return False

    def changed_after_exchange(self, rank: int, step: int, parts: list[str]) -> None:
        rec = self.after_exchange.setdefault(rank, {"parts": [], "first_step": step, "last_step": step, "steps": 0})
        rec["parts"] = sorted(set(rec["parts"]) | set(parts))
        rec["last_step"], rec["steps"] = step, rec["steps"] + 1

    def caveats(self) -> list[dict[str, Any]]:
        """Recoveries whose bitwise equality hotspare cannot vouch for: the lost rank's script
        changes its per-rank state after the step's gradient exchange (a rank-0-only evaluation
        after the backward or after the step block), which its replacement cannot receive if
        the rank died between that change and its next exchange."""
        out = []
        for f in self.failures:
            rec = self.after_exchange.get(f.rank)
            if rec is None or f.recovery_path != "memory":
                continue
            out.append({"rank": f.rank, "step": f.step, "parts": rec["parts"], "detail": (
                f"rank {f.rank}'s script changed {', '.join(rec['parts'])} after the gradient exchange "
                f"(first at step {rec['first_step']}, last reported at step {rec['last_step']}): every rank's state at "
                "the top of each loop iteration is gathered as the next step begins, so this is exact unless rank "
                f"{f.rank} died between such a change and the top of its next iteration (e.g. inside the work "
                "itself); then its replacement started without it. To be sure, move that work to the top of the "
                "loop body (before `with step:`) or inside `with torch.random.fork_rng():`")})
        return out

    def holds(self, rank: int, step: int) -> None:
        """``rank`` says (failed, paused) it holds step ``step``'s state committed: a step whose
        optimizer stepped before a later collective of its block failed is committed on that rank
        (runtime/steps.py), though no commit report of it was sent. Counted as reached, so the
        steps completed agree with the state a checkpoint or a source takes from that rank."""
        if step > self.commits.get(rank, -1):
            self.commits[rank] = step

    def max_committed(self) -> int:
        return max(self.commits.values(), default=-1)

    def report(self) -> dict[str, Any]:
        memory = [f for f in self.failures if f.recovery_path == "memory" and f.lost_steps == 0]
        digests = set(self.digests.values())
        return {
            "job": self.settings,
            "outcome": self.outcome,
            "message": self.message,
            "steps_completed": self.max_committed() + 1,
            "total_steps": self.total_steps,
            "steps_repeated": len(self.repeated),
            "failures": [f.to_dict() for f in self.failures],
            "failures_total": len(self.failures),
            "recovered_zero_loss": len(memory),
            "recovered_from_checkpoint": sum(f.recovery_path == "checkpoint" for f in self.failures),
            # one recovery can follow several failures (e.g. every rank at once): count it once
            "steps_lost": sum({f.generation: f.lost_steps or 0 for f in self.failures}.values()),
            "checkpoints_written": len(self.checkpoints),
            "checkpoint_fallbacks": list(self.checkpoint_fallbacks),   # checkpoints refused on load, and what was used
            "shard_restores": list(self.shard_restores),   # a sharded job: {"rank", "source", "why", ...} per restore
            "checkpoints": list(self.checkpoints),   # {"step", "path", "generation" it was reported in}, in order
            "zero_loss_share": (len(memory) / len(self.failures)) if self.failures else None,
            # recoveries that may not be bitwise (see caveats()); "exact_share" counts the others
            "caveats": self.caveats(),
            "changed_after_exchange": {str(r): dict(v) for r, v in sorted(self.after_exchange.items())},
            "final_state_digest": next(iter(digests)) if len(digests) == 1 else None,
            "replica_digests": {str(r): d for r, d in sorted(self.digests.items())},
            "replicas_consistent": len(digests) <= 1,
            # per-rank state (generators, module buffers, data position): differs between ranks by design;
            # compare each rank's with the same rank's in a run without failures
            "rank_digests": {str(r): d for r, d in sorted(self.rank_digests.items())},
            "migrations": [m.to_dict() for m in self.migrations],
            "migrations_total": sum(m.outcome == "migrated" for m in self.migrations),
            "health_events": self.health_events,
            "devices": self.devices,
            "nodes": self.nodes,
            "wall_time_s": round(time.time() - self.started, 3),
            # CPU of the launcher process (coordinator, its node agents, the health service)
            "launcher_cpu_s": round(time.process_time(), 3),
            "median_step_time_s": round(statistics.median(self.step_times), 6) if self.step_times else None,
            # the mean counts what happens every N steps only (a periodic vote, a checkpoint)
            "mean_step_time_s": (round(statistics.fmean(self.step_times[5:] or self.step_times), 6)
                                 if self.step_times else None),
            # the health checks measured inside the step on rank 0 (scaling and NaN scan, the fingerprint and
            # the vote's launch), averaged over every step: the vote runs every N steps
            "health_check_s_per_step": round(statistics.fmean(self.check_times), 6) if self.check_times else None,
            "health_check_cpu_s_per_step": (round(statistics.fmean(self.check_cpu_times), 6)
                                            if self.check_cpu_times else None),
            "fingerprint_s_per_step": (round(statistics.fmean(self.fingerprint_times), 6)
                                       if self.fingerprint_times else None),
        }
