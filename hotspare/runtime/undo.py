"""Undo what a failed attempt's loop iteration did to tracked state outside its step block.

Python cannot skip the code after a ``with step:`` block: when the block's step fails and is
recovered, the rest of the loop body still runs (``sched.step()`` after the block, an EMA
update, a rank-0 evaluation) for an attempt that was never committed, and then the loop runs
the step again. So that the re-run starts from exactly the committed state, the job takes an
``Undo`` when a failed step had not applied its update, and applies it at the top of the next
iteration (``Job._resume_point``), before the step is run again:

* objects whose state the optimizer does not own (schedulers, scalers, an EMA model, your own
  objects) are copied, and loaded back if the iteration changed them;
* optimizers' hyperparameters (``param_groups``: the learning rate a scheduler sets) are put back;
* the parameters of trained models and the optimizers' state are not copied (that would double
  the job's memory): they are fingerprinted, and changing them after a failed step block is a
  clear error (``StateTrackingError``) that says to move that code into the block.

Per-rank state (generators, buffers, data position) is put back by the job itself, to what it
was at the top of the iteration (runtime/job.py). Plain Python variables are not undone: count
with the loop's step number, not a counter of your own.
"""
from __future__ import annotations

import copy
import hashlib
from typing import Any

import torch

from hotspare.errors import StateTrackingError


def _tensor_sum(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach()
        if hasattr(t, "to_local"):       # a DTensor (a sharded job): this rank's shard
            t = t.to_local()
        if t.device.type != "cpu":
            t = t.cpu()
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _hyper(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]


class Undo:
    """The committed state of everything a loop iteration can touch outside its step block."""

    def __init__(self, objects: dict[str, Any]) -> None:
        optimizers = {n: o for n, o in objects.items() if isinstance(o, torch.optim.Optimizer)}
        trained = {id(p) for o in optimizers.values() for g in o.param_groups for p in g["params"]}
        self._objects = objects
        self._hyper = {n: _hyper(o) for n, o in optimizers.items()}
        self._copies: dict[str, Any] = {}
        self._sums: dict[str, str] = {}
        for name, obj in objects.items():
            if isinstance(obj, torch.optim.Optimizer):
                self._sums[name] = _tensor_sum(_opt_tensors(obj))
            elif isinstance(obj, torch.nn.Module) and any(id(p) in trained for p in obj.parameters()):
                self._sums[name] = _tensor_sum([p for p in obj.parameters()])
            else:
                self._copies[name] = copy.deepcopy(obj.state_dict())

    def restore(self) -> list[str]:
        """Put the committed state back; the names of the objects that had changed."""
        changed = []
        for name, sd in self._copies.items():
            obj = self._objects[name]
            if not _equal(obj.state_dict(), sd):
                obj.load_state_dict(sd)
                changed.append(name)
        for name, groups in self._hyper.items():
            opt = self._objects[name]
            if not _equal([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups], groups):
                for g, saved in zip(opt.param_groups, groups):
                    g.update(copy.deepcopy(saved))
                changed.append(f"{name}.param_groups")
        for name, digest in self._sums.items():
            obj = self._objects[name]
            now = _opt_tensors(obj) if isinstance(obj, torch.optim.Optimizer) else list(obj.parameters())
            if _tensor_sum(now) != digest:
                raise StateTrackingError(
                    f"the code after the `with step:` block changed {name!r} (its parameters or optimizer state) "
                    "for a step that failed and was recovered: hotspare cannot put them back without a copy of "
                    "the model. Move that code into the step block, where a failed attempt is undone")
        return changed


def _opt_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:       # an object whose == is not a bool
        return False


__all__ = ["Undo"]
