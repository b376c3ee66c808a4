"""Buddy snapshots: a rank's committed shards, packed, checksummed, sent to the rank that keeps
them (its buddy, hotspare/sharded/plan.py ``buddy_of``) and kept there in host RAM.

A ``Packet`` is one flat byte buffer (the tensors back to back) with a JSON header: its kind
("state": the shard after an optimizer update; "log": the final gradients of a step and the
optimizer's hyperparameters), the step, every entry's path, dtype and shape, and the sha256 of
the bytes. Nothing is unpickled: the header is JSON, checked field by field; the bytes are only
ever copied into tensors of the dtypes and shapes the receiver's own state has.

On the wire (a gloo group of the generation): [header length, byte count] as int64, the header,
the bytes. A packet whose checksum does not match is never stored or loaded (``BadPacket``).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hotspare.errors import StateMismatch

MAX_HEADER = 1 << 24
MAX_BYTES = 1 << 40
KINDS = ("state", "log")


class BadPacket(StateMismatch):
    """A snapshot or log that is corrupt, incomplete or malformed: never loaded."""


def _dtype(name: Any) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise BadPacket(f"unknown dtype {name!r} in a buddy snapshot header")
    return dt


@dataclass
class Packet:
    kind: str
    step: int
    entries: list[list[Any]]          # [path, dtype, shape]
    data: torch.Tensor                # uint8, the tensors back to back
    sha256: str
    extra: dict[str, Any] = field(default_factory=dict)   # JSON only (a log's hyperparameters)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def header(self) -> bytes:
        return json.dumps({"kind": self.kind, "step": self.step, "entries": self.entries,
                           "sha256": self.sha256, "extra": self.extra}).encode()

    def verify(self) -> None:
        """Raise ``BadPacket`` unless the bytes are the ones the sender hashed."""
        got = hashlib.sha256(self.data.numpy().data).hexdigest()
        if got != self.sha256:
            raise BadPacket(f"buddy {self.kind} of step {self.step}: checksum mismatch "
                            f"(sha256 {got[:12]}…, sent {self.sha256[:12]}…): corrupt, not loaded")

    def tensors(self) -> list[tuple[tuple, torch.Tensor]]:
        """(path, tensor view into the bytes) per entry."""
        out, off = [], 0
        for path, dt, shape in self.entries:
            dt = _dtype(dt)
            n = math.prod(shape) * dt.itemsize
            if off + n > self.data.numel():
                raise BadPacket(f"buddy {self.kind} of step {self.step}: entries overrun the bytes")
            out.append((tuple(path), self.data[off:off + n].view(dt).view(shape)))
            off += n
        if off != self.data.numel():
            raise BadPacket(f"buddy {self.kind} of step {self.step}: {self.data.numel() - off} bytes not described")
        return out


def pack(kind: str, step: int, tensors: list[tuple[tuple, torch.Tensor]], extra: dict | None = None) -> Packet:
    """Copy ``tensors`` (path, tensor) into one buffer and hash it: a consistent copy, taken now."""
    assert kind in KINDS
    entries, total = [], 0
    for path, t in tensors:
        entries.append([list(path), str(t.dtype).removeprefix("torch."), list(t.shape)])
        total += t.numel() * t.element_size()
    data = torch.empty(total, dtype=torch.uint8)
    off = 0
    for _, t in tensors:
        n = t.numel() * t.element_size()
        if n:
            data[off:off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        off += n
    return Packet(kind, step, entries, data, hashlib.sha256(data.numpy().data).hexdigest(), dict(extra or {}))


def parse_header(raw: bytes, nbytes: int) -> dict[str, Any]:
    try:
        h = json.loads(raw)
    except ValueError as e:
        raise BadPacket(f"buddy snapshot header is not JSON: {e}") from None
    ok = (isinstance(h, dict) and h.get("kind") in KINDS and isinstance(h.get("step"), int)
          and isinstance(h.get("entries"), list) and isinstance(h.get("sha256"), str)
          and isinstance(h.get("extra"), dict)
          and all(isinstance(e, list) and len(e) == 3 and isinstance(e[0], list) and isinstance(e[2], list)
                  and all(isinstance(x, int) and x >= 0 for x in e[2]) for e in h["entries"]))
    if not ok:
        raise BadPacket("malformed buddy snapshot header")
    total = sum(math.prod(e[2]) * _dtype(e[1]).itemsize for e in h["entries"])
    if total != nbytes:
        raise BadPacket(f"buddy snapshot header describes {total} bytes, {nbytes} announced")
    return h


def send(packet: Packet, dst: int, group: dist.ProcessGroup) -> None:
    """Blocking send of ``packet`` to group rank ``dst``."""
    head = torch.frombuffer(bytearray(packet.header()), dtype=torch.uint8)
    dist.send(torch.tensor([head.numel(), packet.nbytes], dtype=torch.int64), dst, group=group)
    dist.send(head, dst, group=group)
    if packet.nbytes:
        dist.send(packet.data, dst, group=group)


def recv(src: int, group: dist.ProcessGroup) -> Packet:
    """Blocking receive of a packet from group rank ``src`` (its header checked; its bytes are
    verified by whoever keeps or loads them)."""
    sizes = torch.empty(2, dtype=torch.int64)
    dist.recv(sizes, src, group=group)
    hlen, nbytes = int(sizes[0]), int(sizes[1])
    if not (0 < hlen <= MAX_HEADER and 0 <= nbytes <= MAX_BYTES):
        raise BadPacket(f"buddy snapshot of {hlen}/{nbytes} bytes announced: refused")
    head = torch.empty(hlen, dtype=torch.uint8)
    dist.recv(head, src, group=group)
    h = parse_header(bytes(head.numpy()), nbytes)
    data = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        dist.recv(data, src, group=group)
    # Not hashed here: whoever keeps or loads it verifies it (BuddyStore.confirm / offer_fresh, and
    # the restore before loading), once per use, not twice per step.
    return Packet(h["kind"], h["step"], h["entries"], data, h["sha256"], h["extra"])


class BuddyStore:
    """What a rank keeps for its predecessor (the rank it is buddy of): the newest state
    snapshot and gradient log that arrived whole and verified. ``confirmed`` is the pair the
    last step's gate saw on every rank: a state of step j and the log of step j+1 (or no log).
    ``fresh`` is a state snapshot that arrived after it (of step j+1)."""

    def __init__(self) -> None:
        self.owner: int | None = None          # the rank these copies are of
        self.state: Packet | None = None       # confirmed state snapshot
        self.log: Packet | None = None         # the log on top of it (step state.step + 1) or None
        self.fresh: Packet | None = None       # a newer state snapshot, not yet confirmed by a gate

    def clear(self) -> None:
        self.owner, self.state, self.log, self.fresh = None, None, None, None

    def confirm(self, owner: int, state: Packet, log: Packet | None) -> None:
        state.verify()
        if log is not None:
            log.verify()
            if log.step != state.step + 1 or log.kind != "log":
                raise BadPacket(f"log of step {log.step} on a snapshot of step {state.step}")
        self.owner, self.state, self.log, self.fresh = owner, state, log, None

    def offer_fresh(self, owner: int, state: Packet) -> None:
        state.verify()
        if owner == self.owner and self.state is not None and state.step > self.state.step:
            self.fresh = state

    def steps(self) -> tuple[int, int, int]:
        """(confirmed state step, log step, fresh state step), -2 for none."""
        if self.state is None:
            return -2, -2, -2
        return (self.state.step, self.log.step if self.log is not None else -2,
                self.fresh.step if self.fresh is not None else -2)

    def nbytes(self) -> int:
        return sum(p.nbytes for p in (self.state, self.log, self.fresh) if p is not None)


__all__ = ["BadPacket", "BuddyStore", "Packet", "pack", "parse_header", "recv", "send"]
