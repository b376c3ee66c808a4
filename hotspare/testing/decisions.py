"""Driving the pure policy signal by signal in tests, as the coordinator does."""
from __future__ import annotations

import copy

from hotspare.policy.decide import ClusterView, Decision, Signal, apply, decide, observe


def feed(view: ClusterView, sig: Signal, now: float = 0.0) -> Decision:
    """Signal in, as the coordinator does it: observe, decide (which reads the view only:
    checked on every signal), apply."""
    observe(view, sig)
    before = copy.deepcopy(view)
    d = decide(view, sig, now)
    assert view == before, f"decide changed the view on {sig}"
    for a in d.actions:
        apply(view, a)
    return d


__all__ = ["feed"]
