"""Per-rank state: what legitimately differs between replicas and must survive the loss of its rank.

Replicated state (parameters, optimizer and scheduler state) is the same on every replica, so a
replacement can take it from any survivor. Some state is not: each rank's random generators
(dropout masks, augmentations), the module buffers DDP leaves per rank (BatchNorm's running
statistics after each rank's own forward), each rank's place in its data stream. Taking that
from another rank would give a model that looks right and is not the model of the run without
the failure. So every rank packs its per-rank state into one flat byte tensor of a fixed layout:

* torch's CPU generator (and the current CUDA device's, once CUDA is initialised), Python's
  ``random`` and numpy's legacy global generator;
* every buffer of every tracked module;
* every ``torch.Generator`` given to ``job.track``;
* the position of every ``job.loader`` (runtime/loader.py).

The rows of all ranks are gathered while each step's gradients are reduced (the gather is waited
for before any optimizer steps, so a rank that applied step k holds every rank's state of step
k), and a replacement receives its predecessor's row with the replicated state. A survivor that
re-runs a step restores its own state as it was when the step began.

Nothing here is pickled: Python's and numpy's generator states are packed as fixed-size words
(read fast: runtime/rngstate.py).
"""
from __future__ import annotations

import hashlib
import struct
import sys
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy
import torch

from hotspare.runtime import rngstate as rng

_UNSEEDED = ("rng/python", "rng/numpy")   # seeded from entropy at start: not in the digest


class Part(Protocol):
    """One piece of per-rank state with a fixed size in bytes."""
    name: str
    nbytes: int

    def save(self) -> bytes | torch.Tensor: ...

    def load(self, data: torch.Tensor) -> None: ...


@dataclass
class _Fn:
    name: str
    nbytes: int
    save: Callable[[], Any]
    load: Callable[[torch.Tensor], None]


def _torch_rng() -> _Fn:
    n = torch.get_rng_state().numel()
    return _Fn("rng/torch", n, torch.get_rng_state, lambda d: torch.set_rng_state(d.clone()))


def _cuda_rng() -> _Fn | None:
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    n = torch.cuda.get_rng_state().numel()
    return _Fn("rng/cuda", n, torch.cuda.get_rng_state, lambda d: torch.cuda.set_rng_state(d.clone()))


def _py_rng() -> _Fn:
    return _Fn("rng/python", struct.calcsize(rng.PY_FMT), rng.python_reader() or rng.python_save_public,
               lambda data: rng.python_load(data.numpy().tobytes()))


def _np_rng() -> _Fn | None:
    np = sys.modules.get("numpy")
    if np is None:
        return None
    return _Fn("rng/numpy", struct.calcsize(rng.NP_FMT), rng.numpy_reader(np) or (lambda: rng.numpy_save_public(np)),
               lambda data: rng.numpy_load(np, data.numpy().tobytes()))


def _tensor_part(name: str, t: torch.Tensor) -> _Fn:
    """A buffer, saved and restored in place as raw bytes (its dtype does not matter)."""
    if not t.is_contiguous():
        raise ValueError(f"per-rank buffer {name} is not contiguous")

    def raw() -> torch.Tensor:
        return t.detach().reshape(-1).view(torch.uint8)

    def load(data: torch.Tensor) -> None:
        with torch.no_grad():
            raw().copy_(data)

    return _Fn(name, t.numel() * t.element_size(), lambda: raw().cpu(), load)


def _generator_part(name: str, g: torch.Generator) -> _Fn:
    n = g.get_state().numel()
    return _Fn(f"generator/{name}", n, g.get_state, lambda d: g.set_state(d.clone()))


class RankState:
    """This rank's per-rank state, packed into (and restored from) one byte tensor."""

    def __init__(self) -> None:
        self.modules: dict[str, torch.nn.Module] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.parts: list[Part] = []          # extra parts (job.loader positions)
        self._layout: list[Part] | None = None

    def add_module(self, name: str, module: torch.nn.Module) -> None:
        self.modules[name] = module
        self._layout = None

    def add_generator(self, name: str, g: torch.Generator) -> None:
        if g.device.type != "cpu":
            raise ValueError(f"job.track({name}=...): only CPU generators are supported as per-rank state")
        self.generators[name] = g
        self._layout = None

    def add_part(self, part: Part) -> None:
        self.parts.append(part)
        self._layout = None

    def buffer_names(self) -> dict[str, set[str]]:
        """Tracked module name -> the state-dict keys of its buffers (per-rank, not replicated)."""
        return {name: {k for k, _ in m.named_buffers()} for name, m in self.modules.items()}

    def layout(self) -> list[Part]:
        if self._layout is None:
            parts: list[Part] = [_torch_rng()]
            parts += [p for p in (_cuda_rng(), _np_rng()) if p is not None]
            parts.append(_py_rng())
            for name in sorted(self.modules):
                parts += [_tensor_part(f"buffer/{name}/{k}", b)
                          for k, b in self.modules[name].named_buffers()]
            parts += [_generator_part(n, g) for n, g in sorted(self.generators.items())]
            parts += self.parts
            self._layout = parts
        return self._layout

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.layout())

    def signature(self) -> str:
        """What the layout is, for a clear error when two ranks' layouts differ."""
        return ", ".join(f"{p.name}:{p.nbytes}" for p in self.layout())

    def capture(self, out: torch.Tensor | None = None) -> torch.Tensor:
        layout = self.layout()
        total = sum(p.nbytes for p in layout)
        if out is None or out.numel() != total:
            out = torch.empty(total, dtype=torch.uint8)
        view = out.numpy()                  # numpy's slice assignment: no torch dispatch per part
        off = 0
        for p in layout:
            data = p.save()
            raw = numpy.frombuffer(data, dtype=numpy.uint8) if isinstance(data, bytes) else data.numpy()
            if raw.size != p.nbytes:
                raise ValueError(f"per-rank state {p.name} changed size ({p.nbytes} -> {raw.size} bytes) "
                                 "during the run; hotspare needs a fixed layout")
            view[off:off + p.nbytes] = raw
            off += p.nbytes
        return out

    def restore(self, blob: torch.Tensor, data_position: bool = True) -> None:
        """Load ``blob``; ``data_position=False`` leaves the loaders' positions alone (a loader
        rolls its own position back to the last commit)."""
        layout = self.layout()
        if blob.numel() != sum(p.nbytes for p in layout):
            raise ValueError(f"per-rank state of {blob.numel()} bytes does not fit this rank's layout "
                             f"({self.signature()}); every rank must track the same objects")
        skip = set() if data_position else {id(p) for p in self.parts}
        off = 0
        for p in layout:
            if id(p) not in skip:
                p.load(blob[off:off + p.nbytes])
            off += p.nbytes

    def digest(self, blob: torch.Tensor) -> str:
        """sha256 of the state a run's outcome is judged by. Python's and numpy's global
        generators are left out: they move with the rest, but unless a script seeds them they
        start from the process's own entropy, so they differ between any two runs (their effect
        on training, when a script uses them, shows in the replicated state)."""
        h, off = hashlib.sha256(), 0
        for p in self.layout():
            if p.name not in _UNSEEDED:
                h.update(p.name.encode())
                h.update(blob[off:off + p.nbytes].numpy().tobytes())
            off += p.nbytes
        return h.hexdigest()

    def changed_parts(self, a: torch.Tensor, b: torch.Tensor) -> list[str]:
        """The names of the parts that differ between two captures of this layout."""
        out, off = [], 0
        for p in self.layout():
            if not torch.equal(a[off:off + p.nbytes], b[off:off + p.nbytes]):
                out.append(p.name)
            off += p.nbytes
        return out

    def part_digests(self, blob: torch.Tensor) -> dict[str, str]:
        """Part name -> a short digest: which part of two ranks' states differs."""
        out, off = {}, 0
        for p in self.layout():
            out[p.name] = hashlib.sha256(blob[off:off + p.nbytes].numpy().tobytes()).hexdigest()[:12]
            off += p.nbytes
        return out


class GradState:
    """Which tracked parameters hold a gradient, and how to put them back.

    The step contract for gradients: when a step is re-run, every parameter that had no gradient
    when the step began has none again, and every one that had a gradient holds zeros. That is
    exactly the committed state for scripts that clear gradients at the end of a step
    (``zero_grad()`` -> None, ``zero_grad(set_to_none=False)`` -> zeros), and equivalent for
    scripts that clear them at the start (the first thing the step does is clear them again).
    Gradients that carry over from one step into the next are not supported: accumulate within
    a step (``no_sync`` micro-batches)."""

    def __init__(self) -> None:
        self._params: list[torch.nn.Parameter] = []
        self._ids: set[int] = set()

    def add(self, params) -> None:
        for p in params:
            if id(p) not in self._ids and p.requires_grad:
                self._ids.add(id(p))
                self._params.append(p)

    def mask(self) -> list[int]:
        return [int(p.grad is not None) for p in self._params]

    def reset(self, mask: list[int]) -> None:
        if len(mask) != len(self._params):
            raise ValueError(f"gradient state of {len(mask)} parameters does not fit this rank's "
                             f"{len(self._params)}; every rank must track the same model and optimizer")
        with torch.no_grad():
            for p, has in zip(self._params, mask):
                if not has:
                    p.grad = None
                elif p.grad is None:
                    p.grad = torch.zeros_like(p)
                else:
                    p.grad.zero_()


class RowTable:
    """Every rank's per-rank state at each step, kept where a source can read it; two steps of it.

    A step with a gradient exchange stores its rows in the job's store: as a backward's reduction
    starts (its forward is done), ``begin`` writes this rank's row to the launcher's store under
    its rank and the step's parity, *before* the rank issues its first bucket's all-reduce. The
    store answers a set only once it holds the value, and a bucket's all-reduce completes on a
    rank only once every rank has issued it, so a rank whose exchange completed (and so any rank
    that applied step k) knows that every rank's row of step k is in the store, without a
    collective of its own: one point-to-point write per rank and step (``bench/rows_exchange.py``:
    a tenth of the all-gather this replaced). A step with two backward passes (a GAN's) writes at
    each; the row is then the state as its last exchange began. A step with no exchange at
    all gathers its rows at its end (``close``, a collective every rank issues). Which of these
    runs depends only on the program's path through the step, the same on every rank: never on
    what one rank alone did (a rank-0-only evaluation after the backward). Without a store
    (``begin(group, ...)`` alone: the sharded gate) the rows are all-gathered beside the buckets.

    What a rank changes in its own state after its step's exchange (random numbers drawn by
    rank-0-only work after the backward, after the ``with step:`` block or between steps) is
    published at the top of the next loop iteration (``publish_top``): that rank alone, only
    when its state there differs from the row it stored, writes it to the job's store too, and a
    source that recovers the rank starts it from that row (``start_rows``). ``close`` notices the
    change on the rank that did it (``changed_after_exchange``, runtime/steps.py).

    The rows of the step before stay too (the store keeps two steps per rank, by parity; a rank
    may have begun step k+1 only once every rank's exchange of step k completed): a rank whose
    step fails after the exchange (a failed vote) is still at that step, and may be the source."""

    def __init__(self, state: RankState) -> None:
        self.state = state
        self._kept: list[tuple[int, torch.Tensor]] = []      # (step, rows), newest last, two at most
        self._inflight: tuple[int, Any, torch.Tensor, torch.Tensor] | None = None  # (step, work, rows, own)
        self._own: tuple[int, torch.Tensor] | None = None    # (step, this rank's row) of its last exchange
        self.own_at_commit: torch.Tensor | None = None       # this rank's state as its last step committed
        self._store: tuple[Any, int] | None = None           # (store, world) the rows were last written to
        self._flagged = False                                # the rows in flight carry a flag byte each

    def begin(self, group: Any, world: int, step: int, store: Any = None, rank: int | None = None,
              flag: int | None = None) -> None:
        """``flag``: one byte more per rank, gathered with the rows (a sharded gate's pause vote);
        ``finish`` returns every rank's."""
        if self._inflight is not None:
            return      # this backward's rows are on their way (two DDP models in one backward)
        own = self.state.capture()
        if store is not None and rank is not None:
            # Before this rank's first bucket is issued: see the class's docstring.
            store.set(_row_key(rank, step), _framed(step, own))
            self._store = (store, world)
            self._inflight = (step, None, None, own)
            return
        self._flagged = flag is not None
        sent = own if flag is None else torch.cat([own, torch.tensor([flag], dtype=torch.uint8)])
        wire, rows = _on_wire(group, sent, world)
        self._inflight = (step, group.all_gather(rows, wire), rows, own)

    def publish_top(self, store: Any, rank: int, step: int, own: torch.Tensor) -> bool:
        """At the top of the iteration of ``step``: if this rank's state ``own`` differs from the
        row its peers hold of it (its last exchange's, of step ``step - 1``), write it to the
        job's ``store`` under this rank, before the step begins, so a rank lost in this step is
        restored with what it did after that exchange (an EMA updated after the block, a rank-0
        evaluation). Nothing is written, and nothing waited for, when nothing changed: the common
        case costs one comparison. True when written."""
        held = self._own
        if held is not None and held[0] == step - 1 and held[1].numel() == own.numel() and torch.equal(held[1], own):
            return False
        store.set(_top_key(rank), _framed(step, own))
        return True

    def start_rows(self, step: int, store: Any = None, world: int = 0) -> torch.Tensor | None:
        """Every rank's state to start step ``step + 1`` from: the rows of step ``step``'s last
        exchange, with the row each rank published at the top of that iteration instead where it
        did (``publish_top``; read from ``store``)."""
        rows = self.rows_for(step)
        if rows is None or store is None or world < 1:
            return rows
        rows = rows.clone().view(world, -1)
        for rank in range(world):
            top = _read_framed(store, _top_key(rank), step + 1, rows.shape[1])
            if top is not None:
                rows[rank] = top
        return rows.view(-1)

    def finish(self) -> torch.Tensor | None:
        """Wait for the rows begun; every rank's flag byte when ``begin`` was given one."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return None
        step, work, rows, own = inflight
        flags = None
        if work is not None:
            work.wait()
            rows = rows.cpu()
            if self._flagged:
                table = rows.view(-1, own.numel() + 1)
                rows, flags = table[:, :-1].reshape(-1).clone(), table[:, -1].clone()
            self.keep(step, rows)
        self._own = (step, own)
        return flags

    def close(self, group: Any, world: int, step: int) -> list[str]:
        """At the end of step ``step`` on every rank: gather if the step had no exchange; the
        names of this rank's per-rank parts that changed after its last exchange."""
        self._inflight = None
        now = self.state.capture()
        if self._own is None or self._own[0] != step:
            wire, rows = _on_wire(group, now, world)
            group.all_gather(rows, wire).wait()
            self.keep(step, rows.cpu())
            self._own = (step, now)
            self.own_at_commit = now
            return []
        self.own_at_commit = now
        own = self._own[1]
        if torch.equal(now, own):
            return []
        return self.state.changed_parts(own, now)

    def drop_inflight(self) -> None:
        self._inflight = None

    def keep(self, step: int, rows: torch.Tensor) -> None:
        self._kept = [(s, r) for s, r in self._kept if s != step][-1:] + [(step, rows)]

    def rows_for(self, step: int) -> torch.Tensor | None:
        """Every rank's row of ``step``, flat: kept here (a gather, a restore), else read from the
        store the rows were written to; None when some rank's row of that step is in neither."""
        kept = next((r for s, r in self._kept if s == step), None)
        if kept is not None or self._store is None or self._own is None:
            return kept
        store, world = self._store
        n = self._own[1].numel()
        rows = [_read_framed(store, _row_key(rank, step), step, n) for rank in range(world)]
        return None if any(r is None for r in rows) else torch.cat(rows)


def _top_key(rank: int) -> str:
    return f"hotspare/top/{rank}"


def _row_key(rank: int, step: int) -> str:
    return f"hotspare/row/{rank}/{step % 2}"


def _framed(step: int, own: torch.Tensor) -> bytes:
    """A row as the store holds it: its step and length (int64 each), then its bytes."""
    header = torch.tensor([step, own.numel()], dtype=torch.int64).view(torch.uint8)
    return torch.cat([header, own.cpu()]).numpy().tobytes()


def _read_framed(store: Any, key: str, step: int, n: int) -> torch.Tensor | None:
    """The row under ``key`` if it is of ``step`` and ``n`` bytes long (else None: not there,
    older, or of another layout)."""
    if not store.check([key]):
        return None
    blob = torch.frombuffer(bytearray(store.get(key)), dtype=torch.uint8)
    if blob.numel() < 16:
        return None
    held, size = (int(v) for v in blob[:16].view(torch.int64))
    return blob[16:] if held == step and size == n and blob.numel() == 16 + n else None


def _on_wire(group: Any, own: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's row and the gather's output, on the device the group's collectives need
    (an NCCL generation's ``device``; the host for gloo)."""
    device = getattr(group, "device", None)
    if device is not None and device.type != "cpu":
        own = own.to(device)
    return own, torch.empty(world * own.numel(), dtype=torch.uint8, device=own.device)
