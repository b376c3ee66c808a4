"""Shrinking and regrowing an elastic data-parallel job: pure decisions over virtual ranks.

An ``--elastic MIN`` job always has the N data-parallel ranks it started with, as *virtual*
ranks (runtime/virtual.py). Each worker runs one or more of them in turn, in a step, and the
gradients are summed in virtual-rank order, so where a virtual rank runs never changes a bit of
the result. Shrinking and regrowing are then only moves of virtual ranks between workers:

* **shrink** — a worker is lost and no spare is ready: its virtual ranks go to the survivors
  (each to the one that runs the fewest, the lowest physical rank first), as long as at least
  MIN workers remain. A replacement that is still starting is not waited for: the job shrinks
  now and grows back when it is ready;
* **regrow** — a spare is ready while some worker runs more than one virtual rank: the busiest
  worker's last virtual rank moves to the spare at a step boundary (with its per-rank state).

A worker's physical rank is the order of its lowest virtual rank, so rank 0 is always the
worker that runs virtual rank 0. No I/O, no clocks, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

Holders = Mapping[int, str]          # virtual rank -> worker that runs it


@dataclass(frozen=True)
class Shrink:
    """Run ``holders`` (every virtual rank, on fewer workers) from now on."""
    holders: dict[int, str]
    moved: dict[int, str]            # virtual rank -> the survivor that takes it
    reason: str


@dataclass(frozen=True)
class Regrow:
    """Move virtual rank ``vrank`` from ``source`` to ``spare`` at the next step boundary."""
    vrank: int
    source: str
    spare: str
    holders: dict[int, str]          # the placement after the move
    reason: str


def workers(holders: Holders) -> list[str]:
    """The workers in physical-rank order (by their lowest virtual rank)."""
    first: dict[str, int] = {}
    for v, w in sorted(holders.items()):
        first.setdefault(w, v)
    return sorted(first, key=first.__getitem__)


def physical_ranks(holders: Holders) -> dict[str, int]:
    return {w: i for i, w in enumerate(workers(holders))}


def held_by(holders: Holders, worker: str) -> list[int]:
    return sorted(v for v, w in holders.items() if w == worker)


def decide_shrink(holders: Holders, lost: Sequence[str], elastic_min: int | None,
                  spares_ready: int) -> Shrink | None:
    """Where the lost workers' virtual ranks go, or None: not elastic, a spare is ready (it keeps
    the job at full size), or fewer than ``elastic_min`` would remain."""
    lost_set = set(lost)
    if elastic_min is None or not lost_set:
        return None
    survivors = [w for w in workers(holders) if w not in lost_set]
    if spares_ready > 0 or len(survivors) < max(1, elastic_min):
        return None
    load = {w: len(held_by(holders, w)) for w in survivors}
    rank = {w: i for i, w in enumerate(survivors)}
    new = dict(holders)
    moved: dict[int, str] = {}
    for v in sorted(v for v, w in holders.items() if w in lost_set):
        to = min(survivors, key=lambda w: (load[w], rank[w]))
        new[v] = moved[v] = to
        load[to] += 1
    reason = (f"worker(s) {sorted(lost_set)} lost and no spare: shrinking to {len(survivors)} worker(s) "
              f"(--elastic {elastic_min}); virtual rank(s) " +
              ", ".join(f"{v} -> {w}" for v, w in moved.items()) + ", same global batch")
    return Shrink(dict(sorted(new.items())), moved, reason)


def layout(holders: Holders) -> tuple[dict[int, str], tuple[int, ...]]:
    """(rank -> worker, virtual rank -> rank) of a placement: a generation's members."""
    ranks = physical_ranks(holders)
    return ({r: w for w, r in ranks.items()}, tuple(ranks[w] for _, w in sorted(holders.items())))


def holders_of(members: Mapping[int, str], placement: Sequence[int]) -> dict[int, str]:
    """Virtual rank -> worker, from a generation's members and placement."""
    return {v: members[p] for v, p in enumerate(placement)}


def decide_regrow(holders: Holders, spares: Sequence[str]) -> Regrow | None:
    """One virtual rank back onto a ready spare, or None (nobody runs two, or no spare)."""
    if not spares:
        return None
    load = {w: len(held_by(holders, w)) for w in workers(holders)}
    busiest = max(load, key=lambda w: (load[w], -physical_ranks(holders)[w]))
    if load[busiest] < 2:
        return None
    vrank = held_by(holders, busiest)[-1]
    spare = spares[0]
    new = {**holders, vrank: spare}
    return Regrow(vrank, busiest, spare, dict(sorted(new.items())),
                  f"spare {spare} ready: virtual rank {vrank} moves back from {busiest} "
                  f"(which runs {load[busiest]}) at the next step boundary")


__all__ = ["Holders", "Regrow", "Shrink", "decide_regrow", "decide_shrink", "held_by", "holders_of", "layout",
           "physical_ranks", "workers"]
