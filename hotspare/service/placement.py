"""Where a queued job goes: pure, over the hosts free in the service's pool.

A job asks for ``nodes`` hosts with ``per_node`` ranks each and ``spares`` warm spares. Its
ranks go to hosts registered as workers (not ``--spare``) that have at least ``per_node``
device slots, in name order; a host works for one job at a time. Its spares go to free spare
hosts (``hotspare agent --spare``), as many as cover ``spares`` slots; with none free the job
starts without them, and a spare host that registers later joins it (``Service._give_spare``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    name: str
    devices: tuple[str, ...]
    spare: bool


def place(free: list[Host], nodes: int, per_node: int, spares: int) -> tuple[list[str], list[str]] | None:
    """(rank hosts, spare hosts), or None while too few hosts are free for the ranks."""
    workers = sorted((h for h in free if not h.spare and len(h.devices) >= per_node), key=lambda h: h.name)
    if len(workers) < nodes:
        return None
    spare_hosts, slots = [], 0
    for h in sorted((h for h in free if h.spare and h.devices), key=lambda h: h.name):
        if slots >= spares:
            break
        spare_hosts.append(h.name)
        slots += len(h.devices)
    return [h.name for h in workers[:nodes]], spare_hosts
