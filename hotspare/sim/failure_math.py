"""Closed forms for failures, goodput and spares. Pure math, hours throughout, no numpy.

Failures are a Poisson process: each GPU fails at a constant rate (the *interruption* rate per
GPU-year), so a job of N GPUs sees failures at rate Λ = λN and its MTBF is 1/Λ. Constant rates
ignore infant mortality and wear-out; at fleet scale, over weeks, that is what the published
counts support, and it is the assumption under Young's and Daly's intervals too.

Goodput is the share of wall-clock time that ends up as training progress that is never thrown
away (Meta calls it the effective training time ratio). Both goodput forms are *exact* for the
renewal model they state (failures may also strike while restarting or recovering), rather than
the usual first-order sums, because at 16k GPUs failures are frequent enough for the first-order
terms to overstate the loss by several percent.
"""
from __future__ import annotations

import math

from hotspare.sim.presets import HOURS_PER_YEAR


def failures_per_hour(per_gpu_year: float, gpus: int) -> float:
    """Job failure rate Λ (per hour) for ``gpus`` GPUs failing at ``per_gpu_year`` each."""
    return per_gpu_year * gpus / HOURS_PER_YEAR


def expected_failures(per_gpu_year: float, gpus: int, days: float) -> float:
    return per_gpu_year * gpus * days / 365.0


def p_at_least_one(per_gpu_year: float, gpus: int, days: float) -> float:
    """P(at least one failure during the run) = 1 − exp(−AFR·N·T/365)."""
    return -math.expm1(-expected_failures(per_gpu_year, gpus, days))


def young_interval(stall: float, mtbf: float) -> float:
    """Young (1974): first-order optimal compute time between checkpoints, sqrt(2·C·M)."""
    return math.sqrt(2.0 * stall * mtbf)


def daly_interval(stall: float, mtbf: float) -> float:
    """Daly (2006): higher-order optimum, better than Young's when C is not ≪ M.

    τ = sqrt(2CM)·[1 + ⅓·sqrt(C/2M) + ⅑·(C/2M)] − C for C < 2M, else τ = M.
    """
    if stall >= 2.0 * mtbf:
        return mtbf
    x = stall / (2.0 * mtbf)
    return math.sqrt(2.0 * stall * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - stall


def _expected_span(rate: float, length: float) -> float:
    """(e^{rate·length} − 1)/rate: expected wall time to get through ``length`` of work when
    any failure (at ``rate``) sends you back to its start; the rate → 0 limit is ``length``."""
    return math.expm1(rate * length) / rate if rate > 0.0 else length


def checkpoint_goodput(lam: float, interval: float, stall: float, restart: float) -> float:
    """Checkpoint-restart goodput G = τΛ / ((e^{Λ(τ+C)} − 1)·e^{ΛR}) (Daly 2006).

    τ: compute time between checkpoints, C: stall to write one, R: time from the failure to
    training again (detection, rescheduling, reload). A failure anywhere in τ+C loses the
    segment; a failure during R starts R again.
    """
    return interval / (_expected_span(lam, interval + stall) * math.exp(lam * restart))


def live_goodput(lam: float, fallback: float, downtime: float, step: float, interval: float,
                 stall: float, restart: float, overhead: float) -> float:
    """Goodput with live failover; to first order 1 − G ≈ o_s + C/τ + Λ[(1−p_f)(D + T/2) + p_f(R + τ/2)].

    A share ``fallback`` (p_f) of failures leaves no in-memory copy and costs what a checkpoint
    restart costs (the work since the last checkpoint plus R); the others cost ``downtime`` D of
    wall time plus the step in flight (T/2 on average). The exact renewal form used here, with
    live failures at Λ_l = (1−p_f)Λ and fallbacks at Λ_f = p_fΛ:

      - a live recovery hit by another live failure starts again, so a pause lasts P with
        Laplace transform φ(θ) = (θ+Λ_l)·e^{−(θ+Λ_l)D} / (θ + Λ_l·e^{−(θ+Λ_l)D});
      - a segment (τ of compute + C of stall, stretched by a Poisson number of pauses) survives
        fallbacks with probability s = exp(−(τ+C)·κ), κ = Λ_f + Λ_l·(1 − φ(Λ_f));
      - a fallback restart hit by any failure starts again, so it lasts S(Λ, R) = (e^{ΛR} − 1)/Λ;

        G = (1 − o_s)·τ·(1 − Λ_l·φ(Λ_f)·T/2) / [ (e^{(τ+C)κ} − 1)/Λ_f · (1 + Λ_f·S(Λ, R)) ]

    (Λ_l·τ·φ(Λ_f) is the number of steps in flight lost within a segment that survives). As
    Λ_f → 0 the denominator tends to (τ+C)·e^{Λ_l·D}; with p_f = 1 and o_s = 0 this is exactly
    ``checkpoint_goodput``. The only approximation left is treating D as one number.
    """
    lam_live, lam_fall = (1.0 - fallback) * lam, fallback * lam
    segment = interval + stall
    if lam_fall > 0.0:
        # 1 − φ(Λ_f) = Λ_f·(1 − e^{−x}) / (Λ_f + Λ_l·e^{−x}), x = (Λ_f + Λ_l)·D: written this way it
        # stays accurate when Λ_f is tiny, where computing φ and subtracting would cancel.
        hit = -math.expm1(-(lam_fall + lam_live) * downtime)
        one_minus_phi = lam_fall * hit / (lam_fall + lam_live * (1.0 - hit))
        phi = 1.0 - one_minus_phi
        kappa = lam_fall + lam_live * one_minus_phi
        wall = math.expm1(segment * kappa) / lam_fall * (1.0 + lam_fall * _expected_span(lam, restart))
    else:
        phi = 1.0
        wall = segment * math.exp(lam_live * downtime)
    useful = (1.0 - overhead) * interval * (1.0 - lam_live * phi * step / 2.0)
    return useful / wall


def erlang_b(offered: float, servers: int) -> float:
    """Erlang's loss formula B(S, a), by the stable recurrence B(k) = a·B(k−1) / (k + a·B(k−1))."""
    blocked = 1.0
    for k in range(1, servers + 1):
        blocked = offered * blocked / (k + offered * blocked)
    return blocked


def pool_empty_probability(node_failures_per_hour: float, repair: float, spares: int) -> float:
    """Share of failures that find the warm-spare pool empty (a conservative estimate).

    Treat the pool as ``spares`` servers, each failure as a customer that holds one spare for
    ``repair`` hours, and a failure that finds none as lost: Erlang's B(S, a) with offered load
    a = rate × repair, whatever the repair-time distribution. Here a failure that finds the pool
    empty still sends its node to repair, and that node refills the pool when it comes back, so
    the pool is fuller than in the loss system: the simulator measures a lower share.
    """
    return erlang_b(node_failures_per_hour * repair, spares)


def spares_needed(node_failures_per_hour: float, repair: float, target: float = 0.01) -> int:
    """Smallest warm-spare pool for which at most ``target`` of failures find it empty."""
    offered, spares, blocked = node_failures_per_hour * repair, 0, 1.0
    while blocked > target:
        spares += 1
        blocked = offered * blocked / (spares + offered * blocked)
    return spares
