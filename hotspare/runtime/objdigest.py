"""Per-object digests of a finished job, for ``hotspare verify`` (hotspare/cli/verify.py).

``object_digests(job)`` describes this rank's state at the end of the job object by object:

* every object given to ``job.track`` (a module's parameters and buffers digested apart);
* every ``nn.Module``, ``Optimizer``, LR scheduler and ``GradScaler`` the script built and did
  NOT track, found on the heap (a module only when it is no part of another one found and has
  parameters or buffers);
* the per-rank parts hotspare keeps (torch's, Python's and numpy's generators, the tracked
  ``torch.Generator``s, each ``job.loader``'s position) and the script's own untracked
  ``torch.Generator``s held in its variables.

Each object is named by the script's variable that holds it (a local of any ``__main__`` frame
on the stack, or a ``__main__`` global), else by its type and an index. With the environment
variable ``HOTSPARE_VERIFY_OUT=DIR`` set, the job's end writes them to ``DIR/rank<R>.json``
(``write_verify_digests``), under ``hotspare run`` and plain ``torchrun`` alike. Nothing here
changes any state: it only reads.
"""
from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import sys
import warnings
from typing import Any

import torch

ENV_VERIFY_OUT = "HOTSPARE_VERIFY_OUT"


def _feed(h: Any, value: Any) -> None:
    """Hash a state-dict value canonically: tensors by dtype, shape and bytes; JSON-like values by
    their text; anything else by its type only (its repr may hold a memory address)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{list(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        h.update(b"{")
        for k in sorted(value, key=repr):
            h.update(repr(k).encode())
            _feed(h, value[k])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for v in value:
            _feed(h, v)
        h.update(b"]")
    elif isinstance(value, float) and not math.isfinite(value):
        h.update(repr(value).encode())
    elif value is None or isinstance(value, (bool, int, float, str)):
        h.update(json.dumps(value).encode())
    else:
        h.update(type(value).__name__.encode())


def digest_of(value: Any) -> str:
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()[:16]


def _unwrap(obj: Any) -> Any:
    return obj.module if isinstance(obj, torch.nn.parallel.DistributedDataParallel) else obj


def _describe(obj: Any) -> dict[str, Any]:
    """Type, digest and the parts of one object, with a few counters that explain a difference."""
    obj = _unwrap(obj)
    entry: dict[str, Any] = {"type": type(obj).__name__}
    if isinstance(obj, torch.nn.Module):
        params = {k: p for k, p in obj.named_parameters()}
        buffers = {k: b for k, b in obj.named_buffers()}
        entry["parts"] = {"parameters": digest_of(params), "buffers": digest_of(buffers)}
        entry["digest"] = digest_of([params, buffers])
    elif isinstance(obj, torch.Generator):
        entry["digest"] = digest_of(obj.get_state())
    else:
        sd = obj.state_dict()
        entry["digest"] = digest_of(sd)
        if isinstance(obj, torch.optim.Optimizer):
            steps = [s.get("step") for s in sd["state"].values() if isinstance(s, dict) and "step" in s]
            entry["parts"] = {"state": digest_of(sd["state"]), "param_groups": digest_of(sd["param_groups"])}
            if steps:
                entry["info"] = {"steps": int(float(steps[0]))}
        elif isinstance(sd, dict) and "last_epoch" in sd:
            entry["info"] = {"last_epoch": sd["last_epoch"]}
    return entry


def _script_vars() -> list[tuple[str, Any]]:
    """(name, value) of the script's variables: the locals of every ``__main__`` frame on the
    stack (innermost first), then ``__main__``'s globals."""
    out: list[tuple[str, Any]] = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "__main__":
            out += list(frame.f_locals.items())
        frame = frame.f_back
    main = sys.modules.get("__main__")
    out += [(k, v) for k, v in sorted(vars(main).items()) if not k.startswith("__")] if main is not None else []
    return out


def _names(variables: list[tuple[str, Any]]) -> dict[int, str]:
    """id -> the first variable holding it (a DDP counts as the module it wraps)."""
    names: dict[int, str] = {}
    for k, v in variables:
        names.setdefault(id(_unwrap(v)) if isinstance(v, torch.nn.Module) else id(v), k)
    return names


def script_name(obj: Any) -> str | None:
    """The script's variable that holds ``obj`` (a local of a ``__main__`` frame on the stack,
    or a global of ``__main__``), or None."""
    return _names(_script_vars()).get(id(_unwrap(obj)) if isinstance(obj, torch.nn.Module) else id(obj))


def _untracked(job: Any) -> list[Any]:
    """The script's modules, optimizers, schedulers and scalers that ``job.track`` was not given."""
    tracked = [_unwrap(o) for o in job.registry.objects().values()]
    inside: set[int] = set()
    for o in tracked:
        if isinstance(o, torch.nn.Module):
            inside.update(id(m) for m in o.modules())
    inside.update(id(o) for o in tracked)
    kinds = (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
             torch.optim.lr_scheduler.ReduceLROnPlateau, torch.amp.GradScaler)
    with warnings.catch_warnings():           # isinstance() on deprecated torch objects warns
        warnings.simplefilter("ignore")
        found = [o for o in gc.get_objects() if isinstance(o, kinds)
                 and not isinstance(o, torch.nn.parallel.DistributedDataParallel)]
    modules = [m for m in found if isinstance(m, torch.nn.Module)]
    for m in modules:                         # a module inside another found one is part of it
        inside.update(id(c) for c in m.modules() if c is not m)
    stateless = lambda o: isinstance(o, torch.nn.Module) and not any(  # noqa: E731  (a loss, an activation)
        True for _ in o.parameters()) and not any(True for _ in o.buffers())
    return [o for o in found if id(o) not in inside and not stateless(o)]


def _shape(obj: Any) -> str:
    """What an object is, without its values: the same in every process of a run, so that objects
    no variable names are indexed alike on every rank and in every run."""
    if isinstance(obj, torch.nn.Module):
        what = [(k, list(t.shape)) for k, t in [*obj.named_parameters(), *obj.named_buffers()]]
    elif isinstance(obj, torch.optim.Optimizer):
        what = [[list(p.shape) for p in g["params"]] for g in obj.param_groups]
    else:
        what = type(getattr(obj, "optimizer", None)).__name__
    return f"{type(obj).__name__} {what}"


def object_digests(job: Any) -> dict[str, Any]:
    """This rank's state object by object (module docstring); JSON-ready."""
    variables = _script_vars()
    names = _names(variables)
    objects: dict[str, dict[str, Any]] = {}
    for name, obj in sorted(job.registry.objects().items()):
        entry = _describe(obj)
        entry.update(how="tracked", var=names.get(id(_unwrap(obj)), name))
        objects[name] = entry
    counts: dict[str, int] = {}
    for obj in sorted(_untracked(job), key=_shape):   # unnamed ones get an index by type and shape
        entry = _describe(obj)
        var = names.get(id(obj))
        if var is None:
            i = counts[entry["type"]] = counts.get(entry["type"], -1) + 1
            key = f"{entry['type']}#{i}"
        else:
            key = var
        entry.update(how="untracked", var=var)
        objects.setdefault(key, entry)
    blob = job.rankstate.capture()
    for part, digest in job.rankstate.part_digests(blob).items():
        if part.startswith("buffer/"):
            continue                          # in the tracked module's "buffers" part
        kind = "loader" if not part.startswith(("rng/", "generator/")) else "generator"
        objects[part] = {"type": kind, "how": "per-rank", "digest": digest, "var": None}
    seen = {id(g) for g in job.rankstate.generators.values()}      # tracked: in the parts above
    for var, obj in variables:
        if isinstance(obj, torch.Generator) and id(obj) not in seen and var not in objects:
            seen.add(id(obj))
            objects[var] = {"type": "Generator", "how": "untracked", "var": var, "digest": digest_of(obj.get_state())}
    return {"rank": job.rank, "world_size": job.world_size, "step": job.committed,
            "digest": job.digest, "rank_digest": job.rank_digest, "objects": objects}


def write_verify_digests(job: Any) -> str | None:
    """Write ``object_digests(job)`` to ``$HOTSPARE_VERIFY_OUT/rank<R>.json`` (atomically);
    nothing when the variable is not set. Returns the path written."""
    out = os.environ.get(ENV_VERIFY_OUT)
    if not out:
        return None
    data = object_digests(job)
    path = os.path.join(out, f"rank{data['rank']}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path
