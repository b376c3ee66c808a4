"""Reading what tests/scripts/elastic.py prints: which samples each virtual rank trained at each
step, and each virtual rank's final digest."""
from __future__ import annotations

import re


def trained(output: str) -> dict[tuple[int, int], list[int]]:
    """(step, virtual rank) -> the sample indices it trained (an attempt that did not commit
    printed the same batch its re-run trains: the re-run's line overwrites it)."""
    out = {}
    for step, shares in re.findall(r"ELASTIC step (\d+) rank \d+ trained (.*)", output):
        for share in shares.split():
            v, idx = share.split(":")
            out[int(step), int(v)] = [int(i) for i in idx.split(",")]
    return out


def virtual_digests(output: str) -> dict[str, str]:
    return dict(re.findall(r"ELASTIC virtual (\d+) digest (\w+)", output))


__all__ = ["trained", "virtual_digests"]
