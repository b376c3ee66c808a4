"""Sharded checkpoints: every rank writes its own shard; one signed index makes them a checkpoint.

A sharded (FSDP2 / HSDP) job's state is split across its ranks, so no one rank can write it.
Each rank writes what it holds -- the local tensors of its tracked objects (its parameter and
optimizer-state shards, and any replicated tensors), their JSON manifest, and its per-rank row
(generators, buffers, data position) -- as two files; the job's rank 0 then signs an index
(``hotspare.json``, the same signed sidecar as every hotspare checkpoint: ``sidecar.encode``)
that lists every file's sha256. Layout::

    step-000000012/
        rank-00000.json   the rank's header: step, rank, world, fingerprint, its entries
                          (path, dtype, shape), the sha256 of its bytes, its registry manifest
        rank-00000.bin    the tensors' raw bytes, back to back (the last entry: the per-rank row)
        rank-00001.json  rank-00001.bin  ...
        hotspare.json     signed (HMAC-SHA256 under the checkpoint key): the sha256 of every file

Nothing is unpickled (DCP's ``.metadata`` is a pickle: it is not used here). Loading checks,
before any byte is interpreted: the index's MAC, that the folder holds exactly the files it
lists, the sha256 of the rank's header and of its bytes (from the very bytes then used), the
header's fields one by one, and that every entry fits the bytes. ``verify`` (checkpoint.sidecar,
which the coordinator runs before it orders a restore) checks every shard's digest.

Writing needs no collective (a peer that dies cannot hang it): each rank writes its two files
into the step's shared ``.tmp-step-<N>-<gen>`` folder (its header last, renamed into place);
rank 0 waits for every rank's header, signs the index and publishes the folder as
``store.save`` does (rename, then ``LATEST``). A rank that never writes leaves the folder
unpublished: it never counts.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hotspare.checkpoint.layout import (FORMAT_VERSION, SIDECAR, SIDECAR_MAX, CheckpointError,
                                        CheckpointInfo, fsync_dir, meta_digest, prune, publish_step, read_bounded,
                                        write_file_durably)
from hotspare.checkpoint.sidecar import encode, info_of, read_sidecar, verified

KIND = "sharded"
ROW = "__rank_state__"          # the last entry of a rank's bytes: its per-rank row
MAX_SHARD_BYTES = 1 << 40
WAIT_POLL_S = 0.05


def shard_names(rank: int) -> tuple[str, str]:
    return f"rank-{rank:05d}.json", f"rank-{rank:05d}.bin"


def tmp_folder(directory: str, step: int, gen: int) -> str:
    """The folder every rank of generation ``gen`` writes step ``step``'s shards into
    (``layout.TMP_RE``: pruned with the other leftovers once a newer step is published)."""
    return os.path.join(directory, f".tmp-step-{step}-{gen}")


def is_sharded(side: dict) -> bool:
    return isinstance(side.get("meta"), dict) and side["meta"].get("kind") == KIND


@dataclass
class Shard:
    """One rank's part of a sharded checkpoint, read and verified."""
    step: int
    rank: int
    world: int
    fingerprint: str
    manifest: dict[str, Any]                    # the registry's manifest (runtime/state.py)
    tensors: list[tuple[tuple, torch.Tensor]]   # (path, tensor) in manifest order
    row: torch.Tensor | None                    # the per-rank row, uint8
    info: CheckpointInfo


# ---------------------------------------------------------------------------------------- write
def _dtype(name: Any) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in a sharded checkpoint header")
    return dt


def write_shard(folder: str, step: int, rank: int, world: int, fingerprint: str,
                manifest: dict[str, Any], tensors: list[tuple[tuple, torch.Tensor]],
                row: torch.Tensor | None) -> None:
    """Write this rank's two files into ``folder`` (created if needed): the bytes (fsynced),
    then the header, renamed into place, so a present header means a complete shard."""
    parts = [(tuple(p), t.detach().contiguous()) for p, t in tensors]
    if row is not None:
        parts.append(((ROW,), row.detach().contiguous().view(torch.uint8)))
    os.makedirs(folder, exist_ok=True)
    head_name, bin_name = shard_names(rank)
    h, entries, total = hashlib.sha256(), [], 0
    with open(os.path.join(folder, bin_name), "wb") as f:
        for path, t in parts:
            data = t.cpu().reshape(-1).view(torch.uint8).numpy().data if t.numel() else b""
            h.update(data)
            f.write(data)
            entries.append([list(path), str(t.dtype).removeprefix("torch."), list(t.shape)])
            total += t.numel() * t.element_size()
        f.flush()
        os.fsync(f.fileno())
    header = {"kind": KIND, "step": step, "rank": rank, "world": world, "fingerprint": fingerprint,
              "entries": entries, "nbytes": total, "sha256": h.hexdigest(), "manifest": manifest}
    data = json.dumps(header, sort_keys=True)
    if len(data) > SIDECAR_MAX:
        raise CheckpointError(f"rank {rank}'s sharded checkpoint header would be {len(data) >> 20} MiB, more "
                              f"than the {SIDECAR_MAX >> 20} MiB hotspare reads back: track fewer, larger tensors")
    tmp = os.path.join(folder, f".{head_name}.tmp")
    write_file_durably(tmp, data)
    os.replace(tmp, os.path.join(folder, head_name))


def publish(directory: str, folder: str, step: int, world: int, fingerprint: str, *, key: bytes,
            timeout_s: float = 120.0, keep: int = 2, cancelled: Callable[[], bool] | None = None
            ) -> CheckpointInfo:
    """Rank 0: wait until every rank's header is in ``folder``, sign the index over every file,
    and publish the folder as ``step-<N>`` (atomically; ``LATEST`` then names it). Given up
    (never published) after ``timeout_s``, or as soon as ``cancelled()`` (the generation that
    was writing ended: a lost rank never writes its shard)."""
    names = [n for r in range(world) for n in shard_names(r)]
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(os.path.join(folder, shard_names(r)[0])) for r in range(world)):
        if time.monotonic() > deadline or (cancelled is not None and cancelled()):
            missing = [r for r in range(world) if not os.path.exists(os.path.join(folder, shard_names(r)[0]))]
            raise CheckpointError(f"sharded checkpoint of step {step}: rank(s) {missing} did not write their "
                                  f"shard ({'their generation ended' if time.monotonic() <= deadline else f'within {timeout_s:.0f} s'}); not published")
        time.sleep(WAIT_POLL_S)
    files, digest, nbytes = {}, hashlib.sha256(), 0
    for r in range(world):
        head_name, bin_name = shard_names(r)
        raw = read_bounded(os.path.join(folder, head_name), SIDECAR_MAX)
        head = json.loads(raw)
        files[head_name] = hashlib.sha256(raw).hexdigest()
        files[bin_name] = head["sha256"]         # the writer's; verify() checks the bytes against it
        digest.update(head["sha256"].encode())
        nbytes += int(head["nbytes"])
    meta = {"kind": KIND, "world": world}
    meta_json = json.dumps(meta, sort_keys=True)
    side = {"version": FORMAT_VERSION, "step": step, "fingerprint": fingerprint, "digest": digest.hexdigest(),
            "nbytes": nbytes, "saved_at": time.time(), "tensors": {}, "meta_digest": meta_digest(meta_json),
            "meta": meta, "files": dict(sorted(files.items()))}
    assert set(files) == set(names)
    write_file_durably(os.path.join(folder, SIDECAR), encode(side, key).decode("ascii"))
    fsync_dir(folder)
    final = publish_step(directory, folder, step)
    prune(directory, keep, step)
    return info_of(final, side)


# ---------------------------------------------------------------------------------------- read
def _corrupt(ckpt: str, what: str) -> CheckpointError:
    return CheckpointError(f"corrupt sharded checkpoint {ckpt}: {what}; not loaded (an older checkpoint "
                           f"is used if one verifies)")


def read_shard(ckpt: str, rank: int, world: int, *, key: bytes, fingerprint: str | None = None) -> Shard:
    """Rank ``rank``'s shard of the checkpoint folder ``ckpt``, verified (see the module doc)
    before anything but the signed index is parsed."""
    side = read_sidecar(ckpt, key)                    # the MAC, before anything else
    if not is_sharded(side):
        raise CheckpointError(f"{ckpt} is not a sharded checkpoint (it holds one replica's state, "
                              "written by a data-parallel job); a sharded job cannot load it")
    if side["meta"].get("world") != world:
        raise CheckpointError(f"sharded checkpoint {ckpt} holds {side['meta'].get('world')} shards; this job "
                              f"has {world} ranks: restart it with that many ranks")
    files = side["files"]
    present = set(os.listdir(ckpt)) - {SIDECAR}
    if present != set(files):
        raise _corrupt(ckpt, f"it holds other files than its index lists (unexpected "
                             f"{sorted(present - set(files))}, missing {sorted(set(files) - present)})")
    head_name, bin_name = shard_names(rank)
    try:
        raw = read_bounded(os.path.join(ckpt, head_name), SIDECAR_MAX)
    except OSError as e:
        raise _corrupt(ckpt, f"{head_name} cannot be read ({e})") from None
    if hashlib.sha256(raw).hexdigest() != files.get(head_name):
        raise _corrupt(ckpt, f"{head_name} was changed after it was signed (sha256 mismatch)")
    try:
        h = json.loads(raw)
    except ValueError as e:
        raise _corrupt(ckpt, f"{head_name} is not JSON ({e})") from None
    ok = (isinstance(h, dict) and h.get("kind") == KIND and h.get("step") == side["step"]
          and h.get("rank") == rank and h.get("world") == world and isinstance(h.get("fingerprint"), str)
          and isinstance(h.get("nbytes"), int) and 0 <= h["nbytes"] <= MAX_SHARD_BYTES
          and h.get("sha256") == files.get(bin_name) and isinstance(h.get("manifest"), dict)
          and isinstance(h.get("entries"), list)
          and all(isinstance(e, list) and len(e) == 3 and isinstance(e[0], list) and isinstance(e[1], str)
                  and isinstance(e[2], list) and all(isinstance(x, int) and x >= 0 for x in e[2])
                  for e in h["entries"]))
    if not ok:
        raise _corrupt(ckpt, f"{head_name} is not a header of rank {rank} of step {side['step']}")
    if fingerprint is not None and h["fingerprint"] != fingerprint:
        raise CheckpointError(f"foreign checkpoint {ckpt}: rank {rank}'s shard was saved by a job with a different "
                              "model or sharding; point the job at its own checkpoint directory")
    sizes = [math.prod(e[2]) * _dtype(e[1]).itemsize for e in h["entries"]]
    if sum(sizes) != h["nbytes"]:
        raise _corrupt(ckpt, f"{head_name} describes {sum(sizes)} bytes, {h['nbytes']} announced")
    try:
        data = read_bounded(os.path.join(ckpt, bin_name), h["nbytes"])
    except OSError as e:
        raise _corrupt(ckpt, f"{bin_name} cannot be read ({e})") from None
    if len(data) != h["nbytes"] or hashlib.sha256(data).hexdigest() != h["sha256"]:
        raise _corrupt(ckpt, f"{bin_name} failed its checksum (its bytes are not the ones its writer signed)")
    buf = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    out, row, off = [], None, 0
    for (path, dt, shape), n in zip(h["entries"], sizes):
        dt = _dtype(dt)
        raw = buf[off:off + n]
        t = (raw if off % dt.itemsize == 0 else raw.clone()).view(dt).view(shape)   # a view needs alignment
        off += n
        if path == [ROW]:
            row = t
        else:
            out.append((tuple(path), t))
    return Shard(side["step"], rank, world, h["fingerprint"], h["manifest"], out, row, info_of(ckpt, side))


def verify_all(ckpt: str, key: bytes) -> CheckpointInfo:
    """The index's MAC and every listed file's sha256 (``sidecar.verified``): what the
    coordinator runs before it orders a restore."""
    side, _ = verified(ckpt, key)
    return info_of(ckpt, side)


__all__ = ["KIND", "ROW", "Shard", "is_sharded", "publish", "read_shard", "shard_names", "tmp_folder",
           "verify_all", "write_shard"]
