"""Virtual ranks: an elastic data-parallel job whose arithmetic does not depend on how many
processes run it.

An elastic job has N *virtual* ranks for its whole life (its size at start). Each process runs
one or more of them in turn inside a step (``shares()``): for each, it swaps in that virtual
rank's per-rank state — torch's generator, the DDP module's buffers, its own data stream (a
``ResumableLoader`` over the loader built for that virtual rank: its sampler shard, in order) —
runs the script's forward and backward on that virtual rank's micro-batch, and keeps the raw
gradient. At the last share of the step the gradients of every virtual rank are all-gathered
and summed in virtual-rank order, each divided by N first (DDP's own scaling): the same bytes
added in the same order whatever the placement, so a job shrunk to fewer processes, or grown
back, computes exactly the bits of the fault-free elastic run (tests/runtime/test_virtual.py).

What differs from plain DDP (and torchrun): the summation order of the reduction (a sequential
sum in virtual-rank order instead of gloo's or NCCL's ring), and each virtual rank's gradient
crosses the network whole (an all-gather: N gradients per process instead of an all-reduce's
two). Supported: one ``job.ddp`` module, one backward per virtual rank per step, one optimizer
step per step. Refused: ``find_unused_parameters``, buffers broadcast by DDP (pass
``broadcast_buffers=False``: each virtual rank keeps its own), gradient-as-bucket-view.

``place(placement)`` moves virtual ranks between processes (a shrink or a regrow, at a step
boundary): every process exports the state of the virtual ranks it runs, the rows are
all-gathered, and each takes the rows of the virtual ranks it runs from now on.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from hotspare.runtime.loader import ResumableLoader

_RNG = torch.get_rng_state().numel()


class VirtualRanks:
    """N virtual ranks of ``ddp``, the ones of ``placement`` (virtual -> physical rank) with
    this process's ``rank`` run here. ``make_loader(vrank, vworld)`` builds the DataLoader of
    one virtual rank (e.g. with ``DistributedSampler(ds, num_replicas=vworld, rank=vrank)``);
    virtual rank v's torch generator starts from ``torch.manual_seed(seed + v)``."""

    def __init__(self, ddp: torch.nn.Module, *, vworld: int, placement: Mapping[int, int], rank: int,
                 make_loader: Callable[[int, int], Any], seed: int = 0, group: Any = None):
        _check_ddp(ddp)
        if sorted(placement) != list(range(vworld)):
            raise ValueError(f"placement must give a process to each of the {vworld} virtual ranks, got {placement}")
        self.ddp, self.vworld, self.rank, self.group, self.seed = ddp, vworld, rank, group, seed
        self.make_loader = make_loader
        self.buffers = [b for b in ddp.module.buffers()]
        self.loaders: dict[int, ResumableLoader] = {}
        self.slots: dict[int, torch.Tensor] = {}        # virtual rank -> its per-rank state while not current
        self.current: int | None = None
        self._last = False
        self._stash: dict[int, list[torch.Tensor]] = {}   # bucket index -> this step's raw gradients, in share order
        self.placement: dict[int, int] = {}
        self._set_placement(placement)
        outside = torch.get_rng_state()
        for v in self.held:
            torch.manual_seed(seed + v)
            self._loader(v)
            self.slots[v] = self.export_current(v)
        torch.set_rng_state(outside)
        ddp.register_comm_hook(self, _virtual_hook)

    # ------------------------------------------------------------------ placement
    def _set_placement(self, placement: Mapping[int, int]) -> None:
        self.placement = dict(sorted(placement.items()))
        self.held = [v for v, p in self.placement.items() if p == self.rank]
        self.processes = max(self.placement.values()) + 1
        counts = [0] * self.processes
        for p in self.placement.values():
            counts[p] += 1
        self.most = max(counts)                         # rows per process in a gather
        seen = [0] * self.processes
        self.where: list[tuple[int, int]] = []          # virtual rank -> (process, index among its own)
        for v, p in self.placement.items():
            self.where.append((p, seen[p]))
            seen[p] += 1

    def place(self, placement: Mapping[int, int]) -> None:
        """At a step boundary, on every process: run ``placement`` from now on; the virtual
        ranks that move take their per-rank state with them (one all-gather of state rows)."""
        rows = self._gather([self.slots[v] for v in self.held])
        old = self.where
        self._set_placement(placement)
        for v in self.held:
            p, i = old[v]
            if p != self.rank or v not in self.slots:
                self.import_row(v, rows[p][i])
        for v in [v for v in self.slots if v not in self.held]:
            del self.slots[v]
            self.loaders.pop(v, None)

    # ------------------------------------------------------------------ per-virtual-rank state
    def _loader(self, v: int) -> ResumableLoader:
        if v not in self.loaders:
            self.loaders[v] = ResumableLoader(self.make_loader(v, self.vworld), f"virtual{v}",
                                              synced=lambda: None, epoch=lambda: None,
                                              resume_point=lambda _capture: None)
        return self.loaders[v]

    def export_current(self, v: int) -> torch.Tensor:
        """Virtual rank ``v``'s per-rank state as it is now in this process: one uint8 row of a
        fixed layout (torch's generator, the module's buffers, its loader's position)."""
        parts = [torch.get_rng_state()]
        parts += [b.detach().reshape(-1).view(torch.uint8).clone() for b in self.buffers]
        parts.append(self._loader(v).save())
        return torch.cat(parts)

    def import_row(self, v: int, row: torch.Tensor) -> None:
        """Take virtual rank ``v``'s state from a row another process exported."""
        n = _RNG + sum(b.numel() * b.element_size() for b in self.buffers)
        self._loader(v).load(row[n:].clone())
        self.slots[v] = row.clone()

    def _swap_in(self, v: int) -> None:
        row = self.slots[v]
        torch.set_rng_state(row[:_RNG].clone())
        at = _RNG
        with torch.no_grad():
            for b in self.buffers:
                n = b.numel() * b.element_size()
                b.reshape(-1).view(torch.uint8).copy_(row[at:at + n])
                at += n

    # ------------------------------------------------------------------ a step
    def shares(self) -> Iterator[tuple[int, Any]]:
        """``for vrank, batch in vr.shares(): loss(model(batch)).backward()``: each virtual rank
        this process runs, with its state current and its next micro-batch. After the last one,
        the parameters' gradients are the virtual-rank-ordered mean of all N."""
        outside = torch.get_rng_state()
        held = list(self.held)
        try:
            for i, v in enumerate(held):
                self._swap_in(v)
                self.current, self._last = v, i == len(held) - 1
                batch = next(self._loader(v))
                yield v, batch
                self.slots[v] = self.export_current(v)
                self._loader(v).committed()
                if not self._last:            # the next share's backward must not add to this one's
                    for p in self.ddp.module.parameters():
                        p.grad = None
        finally:
            self.current = None
            torch.set_rng_state(outside)
        if self._stash:
            raise RuntimeError(f"virtual ranks: gradient buckets {sorted(self._stash)} were never combined "
                               "(a share without a backward through the DDP module?)")

    # ------------------------------------------------------------------ the gradient exchange
    def combine(self, mine: list[torch.Tensor]) -> torch.Tensor:
        """Every virtual rank's raw gradient of one bucket, gathered; their mean, summed in
        virtual-rank order."""
        rows = self._gather(mine)
        out: torch.Tensor | None = None
        for p, i in self.where:
            g = rows[p][i].div(self.vworld)
            out = g if out is None else out.add_(g)
        return out

    def _gather(self, mine: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each process's rows (``most`` of them, zero-padded), from every process."""
        like = mine[0]
        send = torch.zeros((self.most, like.numel()), dtype=like.dtype)
        for i, t in enumerate(mine):
            send[i].copy_(t.reshape(-1))
        if self.processes == 1:
            return [send]
        out = [torch.empty_like(send) for _ in range(self.processes)]
        dist.all_gather(out, send, group=self.group)
        return out


def _virtual_hook(state: VirtualRanks, bucket):  # no annotations: DDP checks them against real classes
    buf = bucket.buffer()
    state._stash.setdefault(bucket.index(), []).append(buf.clone())
    if state._last:
        buf.copy_(state.combine(state._stash.pop(bucket.index())))
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _check_ddp(ddp: Any) -> None:
    if getattr(ddp, "find_unused_parameters", False):
        raise ValueError("an elastic job's DDP cannot use find_unused_parameters=True (not supported yet)")
    if getattr(ddp, "broadcast_buffers", False) and any(True for _ in ddp.module.buffers()):
        raise ValueError("an elastic job keeps each virtual rank's buffers its own: wrap the model with "
                         "broadcast_buffers=False")
    if getattr(ddp, "gradient_as_bucket_view", False):
        raise ValueError("an elastic job's DDP cannot use gradient_as_bucket_view=True (not supported yet)")


__all__ = ["VirtualRanks"]
