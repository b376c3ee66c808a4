"""Moving a committed state between ranks: one send path, one receive path.

What travels, source to receivers, over the generation's group (``transfer.broadcast_state``):
the replicated state (every tracked tensor, described by a JSON manifest in the store), which
gradients exist (a mask: a re-run of the next step starts from the same ``None``/zero grads),
and rows of per-rank state (runtime/rankstate.py): every rank's row when a replacement joins a
generation, or the migrating rank's own row in a live migration's hand-off.

A receiver that has not tracked its objects yet (a spare taking over in ``init()``, before the
script built its model) keeps what it received aside (``staged``) and applies it at the first
step (``apply_staged``).
"""
from __future__ import annotations

import json
import sys
from typing import Any

import torch

from hotspare.errors import StateMismatch
from hotspare.runtime.rankstate import GradState, RankState, RowTable
from hotspare.runtime.state import StateRegistry
from hotspare.transfer import broadcast_state
from hotspare.transfer.broadcast import TransferStats

MAX_ROWS, MAX_ROW_BYTES = 1 << 20, 1 << 32


class StateSync:
    def __init__(self, registry: StateRegistry, rankstate: RankState, grads: GradState, rows: RowTable):
        self.registry, self.rankstate, self.grads, self.rows = registry, rankstate, grads, rows
        self.staged: tuple | None = None   # (manifest, tensors, rows, rank, world size)

    # ------------------------------------------------------------------ send
    def send(self, store, key: str, step: int, rows: torch.Tensor | None, count: int, source: int,
             receivers: list[int]) -> TransferStats:
        """Publish the manifest of the state at ``step`` under ``key`` and broadcast the state
        with ``count`` rows of per-rank state (``rows`` may be None: none replicated)."""
        snap = self.registry.snapshot()
        manifest = snap.manifest(step)
        manifest["grads"] = self.grads.mask()
        manifest["rows"] = None if rows is None else {"count": count, "nbytes": rows.numel() // count}
        tensors = [t.detach() for _, t in snap.tensors] + ([rows] if rows is not None else [])
        store.set(key, json.dumps(manifest))
        return broadcast_state(tensors, source, None, is_source=True, receivers=receivers)

    # ------------------------------------------------------------------ receive
    def receive(self, store, key: str, sender: str, source: int, receivers: list[int],
                rank: int, world_size: int) -> tuple[int, TransferStats]:
        """Receive what ``send`` sent and take it in; returns (the state's step, stats). ``rank``
        and ``world_size`` are this rank's in the generation the state is for."""
        manifest = check_manifest(json.loads(store.get(key)), sender)
        rows = _rows_buffer(manifest.get("rows"))
        if not self.registry:
            staged = [torch.empty(shape, dtype=_dtype(dt)) for _, dt, shape in manifest["entries"]]
            stats = broadcast_state(staged + _opt(rows), source, None, is_source=False, receivers=receivers)
            self.staged = (manifest, staged, rows, rank, world_size)
            return manifest["step"], stats
        dsts, needs_load = self.registry.prepare_receive(manifest)
        stats = broadcast_state(dsts + _opt(rows), source, None, is_source=False, receivers=receivers)
        with torch.no_grad():
            self.registry.finish_receive(manifest, dsts, needs_load)
        self._take_rank_state(manifest, rows, rank, world_size)
        return manifest["step"], stats

    def apply_staged(self) -> int | None:
        """Apply a state received before the script tracked its objects; its step, or None."""
        if self.staged is None:
            return None
        manifest, staged, rows, rank, world_size = self.staged
        self.staged = None
        dsts, needs_load = self.registry.prepare_receive(manifest)
        with torch.no_grad():
            for dst, src in zip(dsts, staged):
                dst.copy_(src)
            self.registry.finish_receive(manifest, dsts, needs_load)
        self._take_rank_state(manifest, rows, rank, world_size)
        return manifest["step"]

    def _take_rank_state(self, manifest: dict[str, Any], rows: torch.Tensor | None, rank: int,
                         world_size: int) -> None:
        """After the replicated state is in: this rank's own per-rank state and gradients."""
        step = manifest["step"]
        grads = manifest.get("grads")
        if isinstance(grads, list) and all(g in (0, 1) for g in grads):
            self.grads.reset(grads)
        if rows is not None:
            count, nbytes = manifest["rows"]["count"], manifest["rows"]["nbytes"]
            if nbytes != self.rankstate.nbytes:
                raise StateMismatch(f"per-rank state of {nbytes} bytes from the source does not fit this "
                                    f"rank's {self.rankstate.nbytes} ({self.rankstate.signature()}); every rank "
                                    "must track the same objects and build the same loaders")
            table = rows.view(count, nbytes)
            self.rankstate.restore(table[rank if count > 1 else 0])
            self.rows.own_at_commit = None
            if count == world_size:
                self.rows.keep(step, rows)
        elif step >= 0:
            print(f"hotspare: rank {rank}: the per-rank state of step {step} (random generators, "
                  "buffers, data position) was not replicated before its rank was lost; this rank goes on "
                  "from its own, so the run may differ from one without the failure", file=sys.stderr, flush=True)


def check_manifest(manifest: Any, sender: str) -> dict[str, Any]:
    if not isinstance(manifest, dict) or not {"step", "entries", "trees"} <= set(manifest) \
            or not isinstance(manifest["step"], int) or not isinstance(manifest["entries"], list):
        raise StateMismatch(f"malformed state manifest from {sender}")
    return manifest


def _rows_buffer(meta: Any) -> torch.Tensor | None:
    if meta is None:
        return None
    count, nbytes = (meta.get("count"), meta.get("nbytes")) if isinstance(meta, dict) else (None, None)
    if not (isinstance(count, int) and isinstance(nbytes, int) and 0 < count <= MAX_ROWS
            and 0 < nbytes and count * nbytes <= MAX_ROW_BYTES):
        raise StateMismatch(f"malformed per-rank state description from the source: {meta!r}")
    return torch.empty(count * nbytes, dtype=torch.uint8)


def _opt(t: torch.Tensor | None) -> list[torch.Tensor]:
    return [t] if t is not None else []


def _dtype(name: Any) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise StateMismatch(f"unknown dtype {name!r} in a state manifest")
    return dt


__all__ = ["StateSync", "check_manifest"]
