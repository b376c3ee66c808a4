"""Where a lost node's replacement comes from, and what that costs: the model both
``hotspare plan`` (in expectation) and ``hotspare simulate`` (failure by failure) use.

Three live-failover policies, besides checkpoint-restart:

- ``dedicated``: warm spare nodes sit idle, reserved for the job, all year. A replacement is
  ready at once; the price is the reservation.
- ``borrow``: nothing sits idle. The replacement is taken from lower-priority, preemptible work
  running on the same pool (an evaluation, a small experiment). The borrower waits for the lender
  to stop at a step boundary and park its state (``lend_pause``); the lender stays paused (or
  shrunk, if it is elastic) until the failed node is repaired and handed back, then pays
  ``lend_resume`` to start again. When nothing lendable is left, the borrower waits for a cold
  node like a dedicated pool that ran dry.
- ``shrink``: no replacement at all. The job drops the data-parallel copy that lost a node and
  trains on the others, at ``(copies - down) / copies`` of its throughput with the global batch
  kept by accumulation, until the node is repaired; then it stops once more (``downtime``) to
  take it back. Needs at least two copies of the state.

Everything here is pure arithmetic over hours and counts: no numpy, no I/O. The functions that
say what one failure costs (``delay``, ``lender_gpu_hours``) are what the simulator calls per
failure; ``expected_delay`` and ``degraded_share`` are their expectations for the closed form,
so the two are checked against each other rather than written twice.
"""
from __future__ import annotations

import math

POLICIES = ("dedicated", "borrow", "shrink")
LENDERS = ("pause", "shrink")


def lendable_nodes(share: float, job_nodes: int) -> int:
    """Nodes of preemptible work the job may borrow from: ``share`` of its own size, rounded down."""
    return math.floor(share * job_nodes + 1e-9)


def copies(job_nodes: int, replica_nodes: int) -> int:
    """Data-parallel copies of the training state (one copy spans ``replica_nodes`` nodes)."""
    return job_nodes // replica_nodes


def delay(policy: str, path: str, *, downtime: float, lend_pause: float, cold_start: float) -> float:
    """Hours from detection to training again for one failure whose in-memory state survived.

    ``path`` is the recovery path decided for it: "memory" (a replacement was at hand: a spare,
    a borrowed node, or for ``shrink`` none needed) or "wait" (the pool had none: a cold node).
    Checkpoint fallbacks are not priced here; they cost a restart under every policy.
    """
    if path == "wait":
        return cold_start + downtime
    if path != "memory":
        raise ValueError(f"delay: no live-recovery delay for path {path!r}")
    return downtime + (lend_pause if policy == "borrow" else 0.0)


def expected_delay(policy: str, no_replacement: float, *, downtime: float, lend_pause: float,
                   cold_start: float) -> float:
    """Mean of ``delay`` when a share ``no_replacement`` of failures finds the pool empty."""
    def d(path: str) -> float:
        return delay(policy, path, downtime=downtime, lend_pause=lend_pause, cold_start=cold_start)
    return (1.0 - no_replacement) * d("memory") + no_replacement * d("wait")


def lender_gpu_hours(borrowed_nodes: int, hold: float, *, gpus_per_node: int, lender_nodes: int,
                     lender: str, lend_pause: float, lend_resume: float) -> float:
    """GPU-hours of lower-priority work lost by lending ``borrowed_nodes`` nodes for ``hold`` hours.

    A lender that ``pause``s stops whole: all ``lender_nodes`` of its nodes lose the pause, the
    hold and the resume (its other nodes are not counted as reused, so for lenders larger than a
    node this is an upper bound). An elastic lender (``shrink``) loses one node for the hold and
    stops whole only twice, to shrink and to grow back (``lend_pause`` + ``lend_resume``).
    """
    if lender == "pause":
        per_node = lender_nodes * (lend_pause + hold + lend_resume)
    elif lender == "shrink":
        per_node = hold + lender_nodes * (lend_pause + lend_resume)
    else:
        raise ValueError(f"lender must be one of {', '.join(LENDERS)} (got {lender!r})")
    return borrowed_nodes * gpus_per_node * per_node


def warmup(horizon: float, hold: float) -> float:
    """Mean over [0, T] of the nodes in repair, as a share of the steady state, for a run that
    starts with none: 1 − (r/T)(1 − e^{−T/r}) for repairs of mean r (exact when they are
    exponential, as the simulator draws them)."""
    if hold <= 0.0 or horizon <= 0.0:
        return 1.0
    return 1.0 + math.expm1(-horizon / hold) * hold / horizon


def degraded_share(mean_nodes_out: float, n_copies: int) -> float:
    """Mean share of a shrinking job's copies that are down, 1 − exp(−a/c).

    Nodes out for repair at any moment are about Poisson with mean ``a`` (failure rate × node-
    hours out per failure: an M/G/∞ queue, whatever the repair-time distribution); each sits in
    a copy chosen uniformly among ``c``, and a copy is down while any of its nodes is. The
    simulator measures the same share from its own failures and repairs.
    """
    if n_copies < 1:
        raise ValueError("a job has at least one copy of its state")
    return -math.expm1(-mean_nodes_out / n_copies)


def regrow_factor(failures_per_hour: float, degraded: float, regrow: float) -> float:
    """Share of time a shrinking job is not stopped to take a repaired copy back, exp(−r·D).

    A copy comes back when the last of its nodes in repair does: busy periods of its repair
    queue end at rate Λ/c × P(copy whole) per copy, so at r = Λ·(1 − degraded) over the job;
    each return stops the job for ``regrow`` hours, and stops that overlap count once
    (Poisson coverage of the time line).
    """
    return math.exp(-failures_per_hour * (1.0 - degraded) * regrow)
