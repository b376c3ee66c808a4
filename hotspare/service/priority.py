"""A job's priority and preemption policy in the coordinator service (pure, no I/O).

Every job carries a priority, an integer like Kueue's ``WorkloadPriorityClass.value`` or a Slurm
QOS's priority, named by a few classes (``CLASSES``); ``hotspare submit --priority CLASS`` takes a
class name or the integer itself. Higher runs first: the queue is placed in ``queue_order``
(priority, then submission), and a job that loses a rank with no spare left may borrow a
device only from a job of strictly lower priority that was submitted ``--preemptible``
(``hotspare.service.borrow``). ``--elastic MIN_RANKS`` runs the job over virtual ranks: as a
lender above its minimum it shrinks (and grows back when a host is idle again) instead of being
paused whole (its state kept in a signed checkpoint).

docs/DEPLOY.md ("Priorities and borrowed devices") maps the classes onto Kueue and Slurm.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence, TypeVar

# class -> its integer (Kueue WorkloadPriorityClass.value / Slurm QOS Priority carry over as is)
PRODUCTION, RESEARCH, BEST_EFFORT = "production", "research", "best-effort"
CLASSES: dict[str, int] = {PRODUCTION: 1000, RESEARCH: 100, BEST_EFFORT: 0}
DEFAULT_CLASS = RESEARCH
LIMIT = 1_000_000_000        # |priority| at most this (Kueue's value is an int32; PriorityClass caps user values at 1e9)


@dataclass(frozen=True)
class JobPolicy:
    """What a job says of itself towards other jobs."""
    priority: int = CLASSES[DEFAULT_CLASS]
    preemptible: bool = False          # may be paused (signed checkpoint, requeued) to lend its devices
    elastic: int | None = None         # --elastic MIN_RANKS: the fewest ranks it may shrink to (None: never)

    def describe(self) -> dict[str, Any]:
        return {"priority": self.priority, "priority_class": class_name(self.priority),
                "preemptible": self.preemptible, "elastic": self.elastic}

    def short(self) -> str:
        """As `hotspare status` shows it: ``best-effort,preemptible``."""
        return ",".join([class_name(self.priority), *(["preemptible"] if self.preemptible else []),
                         *([f"elastic>={self.elastic}"] if self.elastic is not None else [])])


def parse_priority(text: str | int) -> int:
    """A class name or an integer, as ``--priority`` takes it (ValueError saying what is allowed)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        name = str(text).strip().lower()
        if name in CLASSES:
            return CLASSES[name]
        try:
            value = int(name)
        except ValueError:
            raise ValueError(f"--priority {str(text)[:40]!r}: give a class ({', '.join(_listing())}) or an "
                             "integer") from None
    if not -LIMIT <= value <= LIMIT:
        raise ValueError(f"--priority {value}: give an integer in -{LIMIT}..{LIMIT}, or a class "
                         f"({', '.join(_listing())})")
    return value


def class_name(priority: int) -> str:
    """The class of exactly this value, else the integer itself."""
    return next((name for name, v in CLASSES.items() if v == priority), str(priority))


def check_elastic(elastic: int | None, world: int) -> int | None:
    """``--elastic MIN_RANKS`` for a job of ``world`` ranks (ValueError when it cannot hold)."""
    if elastic is None:
        return None
    if isinstance(elastic, bool) or not isinstance(elastic, int) or not 1 <= elastic <= world:
        raise ValueError(f"--elastic {elastic!r}: give the fewest ranks the job may run on, 1..{world} "
                         f"(its --nodes x --nproc-per-node)")
    return elastic


def policy_of(args: dict[str, Any], world: int) -> JobPolicy:
    """A submit request's policy fields (absent: the defaults), checked."""
    preemptible = args.get("preemptible", False)
    if not isinstance(preemptible, bool):
        raise ValueError("'preemptible' must be true or false")
    elastic = args.get("elastic")
    return JobPolicy(parse_priority(args.get("priority", CLASSES[DEFAULT_CLASS])), preemptible,
                     check_elastic(elastic, world))


T = TypeVar("T")


def queue_order(jobs: Iterable[T], key=lambda j: (j.policy.priority, j.submitted)) -> list[T]:
    """Queued jobs in the order placement tries them: the highest priority first, then the
    earliest submitted (a job paused to lend a device keeps its first submission time, so it
    goes before later work of its class). ``key(job) -> (priority, submitted)``."""
    return sorted(jobs, key=lambda j: (-key(j)[0], key(j)[1]))


def _listing() -> Sequence[str]:
    return [f"{name}={value}" for name, value in CLASSES.items()]
