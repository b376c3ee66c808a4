"""A step's *log* (its final gradient shards and the optimizer's hyperparameters) and its replay.

The optimizer's update is a pure function of the shard it updates, its state, the gradients and
the hyperparameters: run again by the same optimizer code on the same device with the same
inputs, it gives the same bits. So a buddy that holds a rank's snapshot of step s and the logs
of steps s+1 .. T rebuilds the rank's shard of step T by loading the snapshot and stepping the
optimizer once per log, in order (``replay``).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from hotspare.errors import StateMismatch
from hotspare.sharded.localize import local


def params_of(opt) -> list[torch.Tensor]:
    return [q for g in opt.param_groups for q in g["params"]]


def grads(opt) -> tuple[list[tuple[tuple, torch.Tensor]], list[int]]:
    """(("grad", i), local gradient shard) of every parameter of ``opt`` that has one, and the
    indices of those that have none."""
    out, none = [], []
    for i, prm in enumerate(params_of(opt)):
        g = prm.grad
        if g is None:
            none.append(i)
        else:
            out.append((("grad", i), local(g)))
    return out, none


def _jsonable(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str)) or (
        isinstance(v, (list, tuple)) and all(_jsonable(x) for x in v))


def hyper(opt) -> list[dict[str, Any]]:
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params" and _jsonable(v)}
            for g in opt.param_groups]


def set_hyper(opt, groups: list[dict[str, Any]]) -> None:
    if len(groups) != len(opt.param_groups):
        raise StateMismatch("a gradient log's parameter groups differ from the optimizer's")
    for g, vals in zip(opt.param_groups, groups):
        for k, v in vals.items():
            g[k] = tuple(v) if isinstance(g.get(k), tuple) else v


def replay(opt, logs: Iterable[Any], replaying: Callable[[bool], None]) -> None:
    """Step ``opt`` once per log (``transfer/buddy.py`` Packets of kind "log", in step order),
    each from its gradients and hyperparameters; the live gradients and hyperparameters are
    put back after. ``replaying(True/False)`` brackets each step (the gate stays out of it)."""
    params = params_of(opt)
    before = [q.grad for q in params]
    saved = hyper(opt)
    try:
        for log in logs:
            got = {path[1]: t for path, t in log.tensors()}
            set_hyper(opt, log.extra["groups"])
            for i, q in enumerate(params):
                if i in got:
                    g = torch.zeros_like(q)
                    (g.to_local() if isinstance(g, DTensor) else g).copy_(got[i])
                    q.grad = g
                else:
                    q.grad = None
            replaying(True)
            try:
                opt.step()
            finally:
                replaying(False)
    finally:
        set_hyper(opt, saved)
        for q, g in zip(params, before):
            q.grad = g


__all__ = ["grads", "hyper", "params_of", "replay", "set_hyper"]
