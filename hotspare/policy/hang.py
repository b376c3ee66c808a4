"""Hang detection from step heartbeats: pure, so it can be tested by scripting heartbeats.

A rank that stops making progress (SIGSTOP, an infinite loop, a stuck collective) stalls the
whole job: its peers wait for it inside the gradient exchange. So the detector watches the job's
progress (the last committed step, or the forming of the current generation) and, once that is
older than a threshold, tells the stuck rank from the waiting ones:

1. a process the kernel reports as stopped (state ``T``) is hung;
2. otherwise, ranks that never reached the gradient exchange of the newest step while others
   wait in it are stuck in their own compute (or dead in all but name);
3. otherwise nobody stands out (a stuck collective): abort the generation; the ranks that still
   do not report afterwards are fenced.

Slowness is not a hang: the threshold adapts to the measured step time,
``max(floor, factor x median of recent step times)``, so a rank that is slow but still
committing steps keeps the job progressing and is never fenced (stragglers are the health
service's business). Until the first step commits, the step time is taken to be ``floor``.
Defaults: floor 2 s, factor 10 (``hotspare run --hang-floor/--hang-factor``) -- seconds, where
collective timeouts are 30 minutes.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

DEFAULT_FLOOR_S = 2.0
DEFAULT_FACTOR = 10.0


@dataclass(frozen=True)
class RankActivity:
    rank: int
    step: int | None          # last step this rank started
    reducing: int | None      # last step whose gradient exchange it entered
    stopped: bool = False     # the kernel says the process is stopped (state T)


def threshold(step_times: Sequence[float], floor: float = DEFAULT_FLOOR_S,
              factor: float = DEFAULT_FACTOR) -> float:
    recent = list(step_times[-50:])       # the list grows with the run: slice, never copy it whole
    typical = statistics.median(recent) if recent else floor
    return max(floor, factor * typical)


def lenient(limit: float, join_timeout: float, *, recovering: bool, forming: bool) -> float:
    """The threshold while a generation forms: building a group may legitimately take up to the
    join timeout (a member that died after publishing its address is retried until then), and
    a generation's first step follows a state transfer. ``recovering``: the job is between
    generations (twice the join timeout more); ``forming``: the current generation has not
    every member joined or has committed no step yet (one join timeout more)."""
    if recovering:
        return limit + 2 * join_timeout
    if forming:
        return limit + join_timeout
    return limit


def tick_period(limit: float, fastest: float = 0.25, slowest: float = 1.0) -> float:
    """How often the detector must look: a tenth of the threshold (the probe's resolution, see
    the coordinator), within [fastest, slowest]. With 0.7 s steps (threshold 7 s) that is 0.7 s:
    the launcher wakes 1.4 times a second to look, not 4."""
    return min(slowest, max(fastest, limit / 10))


def find_hung(activity: Sequence[RankActivity], stalled_for: float, limit: float) -> tuple[tuple[int, ...], str]:
    """Ranks to fence (possibly none) and the reason; ``((), "")`` when nothing is wrong."""
    if stalled_for < limit:
        return (), ""
    stall = f"no step committed for {stalled_for:.1f} s (threshold {limit:.1f} s)"
    stopped = tuple(a.rank for a in activity if a.stopped)
    if stopped:
        return stopped, f"{stall}; the process of rank(s) {list(stopped)} is stopped"
    started = [a.step for a in activity if a.step is not None]
    if started:
        front = max(started)
        waiting = [a.rank for a in activity if a.reducing == front]
        behind = tuple(a.rank for a in activity if a.reducing != front)
        if waiting and behind:
            return behind, (f"{stall}; rank(s) {list(behind)} never reached the gradient exchange of step "
                            f"{front} while rank(s) {waiting} wait in it")
    return (), f"{stall}; no single rank stands out: aborting the generation"
