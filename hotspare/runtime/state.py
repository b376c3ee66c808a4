"""The state registry: what a replacement rank must receive, and the digest of it.

Objects are registered by name (``model``, ``optimizer``, a scheduler...) and must offer
``state_dict()`` / ``load_state_dict()``. A snapshot splits their state dicts into
* tensors, addressed by a path (object name + keys), which move peer to peer in buckets, and
* everything else, a small JSON tree with tagged containers (so tuples stay tuples and integer
  keys stay integers), which travels as validated metadata. Nothing is ever pickled.

A model's state-dict tensors share storage with its parameters, so a receiver writes received
bytes straight into the live parameters: no second copy of the model in memory.
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from hotspare.errors import ConfigError, StateMismatch

Path = tuple[Any, ...]


def _unwrap(obj: Any) -> Any:
    # DDP's state_dict prefixes every key with "module."; register the bare module instead so
    # that a model wrapped by hotspare and one wrapped by plain DDP transfer alike.
    return getattr(obj, "module", obj) if isinstance(obj, torch.nn.parallel.DistributedDataParallel) else obj


def _encode(value: Any, path: Path, tensors: list[tuple[Path, torch.Tensor]]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append((path, value))
        return {"T": len(tensors) - 1}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"f": repr(value)}
    if isinstance(value, dict):
        return {"d": [[_encode(k, path, tensors), _encode(v, path + (k,), tensors)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, path + (i,), tensors) for i, v in enumerate(value)]
        return {"t" if isinstance(value, tuple) else "l": items}
    raise ConfigError(f"state at {'/'.join(map(str, path))} holds a {type(value).__name__}; hotspare "
                      "transfers tensors and JSON-like values (None, bool, int, float, str, list, "
                      "tuple, dict) only. Keep other objects out of state_dict() or register a "
                      "wrapper whose state_dict() converts them.")


def _decode(node: Any, tensors: list[torch.Tensor]) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if not isinstance(node, dict) or len(node) != 1:
        raise StateMismatch(f"malformed state metadata node: {str(node)[:80]}")
    (tag, body), = node.items()
    if tag == "T":
        return tensors[body]
    if tag == "f":
        return float(body)
    if tag == "l":
        return [_decode(v, tensors) for v in body]
    if tag == "t":
        return tuple(_decode(v, tensors) for v in body)
    if tag == "d":
        return {_decode(k, tensors): _decode(v, tensors) for k, v in body}
    raise StateMismatch(f"unknown state metadata tag {tag!r}")


@dataclass
class Snapshot:
    """Live references to every registered tensor plus the JSON metadata of the rest."""
    tensors: list[tuple[Path, torch.Tensor]] = field(default_factory=list)
    trees: dict[str, Any] = field(default_factory=dict)     # object name -> tagged JSON tree

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    def manifest(self, step: int) -> dict[str, Any]:
        return {
            "step": step,
            "entries": [[list(p), str(t.dtype).removeprefix("torch."), list(t.shape)] for p, t in self.tensors],
            "trees": self.trees,
        }


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise StateMismatch(f"unknown dtype {name!r} in state manifest")
    return dt


def _is_sharded(obj: Any) -> bool:
    # Sharded jobs (hotspare/sharded): an object whose parameters are DTensors moves as its
    # local shards. Nothing to look for when DTensor was never imported.
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from hotspare.sharded.localize import is_sharded
    return is_sharded(obj)


class StateRegistry:
    def __init__(self) -> None:
        self._objs: dict[str, Any] = {}
        self._sharded: set[str] = set()      # objects holding DTensors: their local shards move

    @property
    def sharded(self) -> set[str]:
        return set(self._sharded)

    def _state_dict(self, name: str) -> dict[str, Any]:
        if name in self._sharded:
            from hotspare.sharded.localize import local_state_dict
            return local_state_dict(self._objs[name])
        return self._objs[name].state_dict()

    def _load(self, name: str, sd: Any) -> None:
        if name in self._sharded:
            from hotspare.sharded.localize import load_local_state_dict
            load_local_state_dict(self._objs[name], sd)
        else:
            self._objs[name].load_state_dict(sd)

    def add(self, name: str, obj: Any) -> None:
        obj = _unwrap(obj)
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ConfigError(f"cannot track {name!r}: a {type(obj).__name__} has no state_dict()/"
                              "load_state_dict(); track models, optimizers, schedulers or any object with both")
        if name in self._objs and self._objs[name] is not obj:
            raise ConfigError(f"{name!r} is already tracked; pick another name")
        self._objs[name] = obj
        if _is_sharded(obj):
            self._sharded.add(name)

    def objects(self) -> dict[str, Any]:
        return dict(self._objs)

    def __bool__(self) -> bool:
        return bool(self._objs)

    def snapshot(self, names=None) -> Snapshot:
        """Every tracked object's state (only those of ``names`` when given), encoded."""
        snap = Snapshot()
        for name in sorted(self._objs):
            if names is None or name in names:
                snap.trees[name] = _encode(self._state_dict(name), (name,), snap.tensors)
        return snap

    def digest(self, per_rank: dict[str, set[str]] | None = None) -> str:
        """sha256 over every tracked tensor (and the JSON metadata) in a canonical order.

        ``per_rank`` names, per tracked object, the state-dict keys that legitimately differ
        between replicas (a module's buffers under DDP): they are left out, so the digest is
        the same on every healthy replica; runtime/rankstate.py digests them per rank."""
        snap = self.snapshot()
        skip = {(name, key) for name, keys in (per_rank or {}).items() for key in keys}
        h = hashlib.sha256()
        for path, t in sorted(snap.tensors, key=lambda pt: json.dumps(list(pt[0]), default=str)):
            if path[:2] in skip:
                continue
            t = t.detach().contiguous().reshape(-1)
            h.update(json.dumps([list(path), str(t.dtype)], default=str).encode())
            h.update(t.view(torch.uint8).numpy().data)
        h.update(json.dumps(snap.trees, sort_keys=True).encode())
        return h.hexdigest()

    def prepare_receive(self, manifest: dict[str, Any]) -> tuple[list[torch.Tensor], set[str]]:
        """Destination tensors for every manifest entry, and the objects that need a load.

        A destination is the live local tensor when path, dtype and shape match (received in
        place); otherwise a fresh tensor that ``finish_receive`` hands to ``load_state_dict``.
        """
        local = self.snapshot()
        by_path = {tuple(p): t for p, t in local.tensors}
        missing = set(manifest["trees"]) ^ set(self._objs)
        if missing:
            raise StateMismatch(f"tracked objects differ: source has {sorted(manifest['trees'])}, "
                                f"this rank has {sorted(self._objs)}; every rank must track the same names")
        dsts: list[torch.Tensor | None] = []
        needs_load: set[str] = set()
        fresh: list[tuple[int, torch.dtype, list[int]]] = []
        for path, dtype, shape in manifest["entries"]:
            path = tuple(path)
            dt = _dtype(dtype)
            t = by_path.get(path)
            if t is not None and t.dtype == dt and list(t.shape) == shape and t.is_contiguous():
                dsts.append(t.detach())
            else:
                if isinstance(self._objs[path[0]], torch.nn.Module):
                    got = "missing" if t is None else f"{t.dtype} {list(t.shape)}"
                    raise StateMismatch(f"model state {'.'.join(map(str, path[1:]))}: source has "
                                        f"{dtype} {shape}, this rank has {got}; all ranks must build the same model")
                fresh.append((len(dsts), dt, shape))
                dsts.append(None)
                needs_load.add(path[0])
        # Fresh tensors (a spare's empty optimizer state) are carved out of one buffer per dtype
        # in manifest order, so the transfer can receive whole buckets straight into them.
        for dt in {d for _, d, _ in fresh}:
            mine = [(i, shape) for i, d, shape in fresh if d == dt]
            pool = torch.empty(sum(math.prod(shape) for _, shape in mine), dtype=dt)
            off = 0
            for i, shape in mine:
                n = math.prod(shape)
                dsts[i] = pool[off:off + n].view(shape)
                off += n
        local_paths = {p for p, _ in local.tensors}
        sent_paths = {tuple(e[0]) for e in manifest["entries"]}
        for name in self._objs:
            if local.trees[name] != manifest["trees"][name] or any(
                    p[0] == name for p in local_paths - sent_paths):
                needs_load.add(name)
        return dsts, needs_load

    def finish_receive(self, manifest: dict[str, Any], dsts: list[torch.Tensor], needs_load: set[str]) -> None:
        for name in sorted(needs_load):
            sd = _decode(manifest["trees"][name], dsts)
            try:
                self._load(name, sd)
            except (RuntimeError, ValueError, KeyError) as e:
                raise StateMismatch(f"received state does not load into {name!r}: {e}") from e
