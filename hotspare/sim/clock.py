"""The training clock of a job that shrinks instead of replacing lost nodes.

A shrinking job trains on the copies of its state that are whole: while ``d`` of its ``c`` copies
have a node in repair it progresses at ``(c - d) / c`` of full speed (the global batch is kept,
so each step takes longer), and when a copy's last node comes back the job stops for ``regrow``
hours to take it in again. ``shrink_clock`` turns one seed's failures into the function
E(t) = ∫₀ᵗ rate, so the replay can measure progress in full-speed hours exactly as it does for
the other policies, with ``E(t) - E(resume)`` in place of ``t - resume``.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Callable, Iterable, Sequence


@dataclasses.dataclass(frozen=True)
class Clock:
    """Piecewise-linear E(t) through (times, effective) breakpoints; the last slope continues.
    Plain lists and bisect: the replay calls it once per failure, where numpy's per-call
    overhead would dominate."""
    times: list[float]
    effective: list[float]
    tail_rate: float
    degraded: float      # mean share of copies down over [0, horizon]

    def __call__(self, t: float) -> float:
        times, eff = self.times, self.effective
        if t >= times[-1]:
            return eff[-1] + (t - times[-1]) * self.tail_rate
        i = bisect.bisect_right(times, t)          # times[i-1] <= t < times[i]
        t0, t1 = times[i - 1], times[i]
        return eff[i - 1] + (eff[i] - eff[i - 1]) * (t - t0) / (t1 - t0)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def shrink_clock(times: Sequence[float], repairs: Sequence[float], nodes: Iterable[tuple[int, ...]],
                 copy_of: Callable[[int], int], n_copies: int, regrow: float, horizon: float) -> Clock:
    """E(t) for failures at ``times`` taking ``nodes`` out for ``repairs`` hours each."""
    spans: dict[int, list[tuple[float, float]]] = {}
    for t, repair, hit in zip(times, repairs, nodes):
        for copy in {copy_of(n) for n in hit}:
            spans.setdefault(copy, []).append((t, t + repair))
    events: list[tuple[float, int, int]] = []   # (time, change in copies down, change in pauses)
    for copy_spans in spans.values():
        for start, end in _union(copy_spans):
            events += [(start, 1, 0), (end, -1, 1), (end + regrow, 0, -1)]
    events.sort()
    points, values = [0.0], [0.0]
    down = pauses = 0
    degraded_area = 0.0
    now, effective = 0.0, 0.0
    for t, d_down, d_pause in events:
        if t > now:
            rate = 0.0 if pauses else (n_copies - down) / n_copies
            effective += rate * (t - now)
            degraded_area += down / n_copies * max(0.0, min(t, horizon) - min(now, horizon))
            now = t
            points.append(now)
            values.append(effective)
        down += d_down
        pauses += d_pause
    if now < horizon:
        degraded_area += down / n_copies * (horizon - now)
    tail = 0.0 if pauses else (n_copies - down) / n_copies
    return Clock(points, values, tail, degraded_area / horizon)
