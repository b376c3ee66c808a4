"""The local view of state that holds DTensors (an FSDP2 model, its optimizer).

hotspare's state registry (runtime/state.py) moves plain tensors and JSON. A sharded object's
``state_dict()`` holds DTensors: their *local* tensors are this rank's shard, the bytes it owns.
``local_state_dict`` replaces every DTensor by its local tensor (the same storage: a receiver
writes straight into the live shard), so the registry digests, snapshots and receives shards as
plain tensors, without any collective (a DTensor ``reshape``/``view`` could redistribute) and
without materialising full tensors. ``load_local_state_dict`` puts such a dict back.

For an optimizer the dict remembers which state entries were DTensors (``DTENSOR_KEY``: a JSON
list of [param id, key]), so a spare's fresh optimizer, loaded from it, gets DTensor state laid
out like its parameters again.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hotspare.errors import StateMismatch

DTENSOR_KEY = "hotspare_dtensor_state"


def is_sharded(obj: Any) -> bool:
    """A module or optimizer whose parameters are DTensors."""
    if isinstance(obj, torch.nn.Module):
        return any(isinstance(p, DTensor) for p in obj.parameters())
    if isinstance(obj, torch.optim.Optimizer):
        return any(isinstance(p, DTensor) for g in obj.param_groups for p in g["params"])
    return False


def local(t: Any) -> Any:
    """A DTensor's local tensor (this rank's shard: the same storage), anything else as it is.
    Read from the DTensor's own field: ``to_local()`` runs an autograd Function, about 5 us a call
    here, and these run for every tensor of a shard every step (the gradient log) or every
    snapshot. Checked against ``to_local()`` in tests/sharded/test_local_state.py (torch pinned)."""
    if isinstance(t, DTensor):
        lt = getattr(t, "_local_tensor", None)
        return lt if isinstance(lt, torch.Tensor) else t.to_local()
    return t


def local_state_dict(obj: Any) -> dict[str, Any]:
    sd = obj.state_dict()
    if isinstance(obj, torch.optim.Optimizer):
        marks = []
        state = {}
        for pid, entries in sd["state"].items():
            state[pid] = {}
            for key, v in entries.items():
                if isinstance(v, DTensor):
                    marks.append([pid, key])
                    v = local(v)
                state[pid][key] = v
        return {**sd, "state": state, DTENSOR_KEY: marks}
    return {k: local(v) for k, v in sd.items()}


def load_local_state_dict(obj: Any, sd: dict[str, Any]) -> None:
    if isinstance(obj, torch.optim.Optimizer):
        sd = dict(sd)
        marks = sd.pop(DTENSOR_KEY, [])
        obj.load_state_dict(sd)
        params = [p for g in obj.param_groups for p in g["params"]]
        for pid, key in marks:
            p = params[pid]
            v = obj.state[p][key]
            if not isinstance(v, DTensor):
                if not isinstance(p, DTensor) or tuple(v.shape) != tuple(p.to_local().shape):
                    raise StateMismatch(f"optimizer state {pid}/{key}: a shard of {list(v.shape)} does not fit "
                                        f"this rank's parameter shard")
                obj.state[p][key] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                                       shape=p.shape, stride=p.stride())
        return
    live = obj.state_dict()
    if set(live) != set(sd):
        raise StateMismatch(f"model state keys differ: {sorted(set(live) ^ set(sd))[:5]}")
    with torch.no_grad():
        for k, v in sd.items():
            dst = live[k]
            dst = dst.to_local() if isinstance(dst, DTensor) else dst
            if dst.shape != v.shape or dst.dtype != v.dtype:
                raise StateMismatch(f"model state {k}: {v.dtype} {list(v.shape)} does not fit this rank's "
                                    f"{dst.dtype} {list(dst.shape)}")
            dst.copy_(v)


__all__ = ["DTENSOR_KEY", "is_sharded", "local", "local_state_dict", "load_local_state_dict"]
