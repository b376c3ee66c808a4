"""Processes seen through /proc, shared by the benchmarks: a free port, a process tree, a
process's environment, start time and liveness."""
from __future__ import annotations

import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start ticks) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return rest[0], int(rest[1]), int(rest[19])
    except (OSError, IndexError, ValueError):
        return None


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st:
                children.setdefault(st[1], []).append(int(name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


_BOOT = None


def started_at(pid: int) -> float | None:
    """Epoch seconds at which a process started."""
    global _BOOT
    if _BOOT is None:
        with open("/proc/stat") as f:
            _BOOT = next(float(line.split()[1]) for line in f if line.startswith("btime"))
    st = _stat(pid)
    return None if st is None else _BOOT + st[2] / os.sysconf("SC_CLK_TCK")


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in "ZX"
