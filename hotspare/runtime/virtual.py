"""Virtual ranks: an elastic data-parallel job whose arithmetic does not depend on how many
processes run it.

An elastic job has N *virtual* ranks for its whole life (its size at start). Each process runs
one or more of them in turn inside a step (``shares()``): for each, it swaps in that virtual
rank's per-rank state — torch's generator, the DDP module's buffers, its own data stream (a
``ResumableLoader`` over the loader built for that virtual rank: its sampler shard, in order) —
runs the script's forward and backward on that virtual rank's micro-batch, and keeps the raw
gradient. At the last share of the step every virtual rank's gradient of each DDP bucket is
exchanged exactly — one all-reduce of an [N, bucket] table in which each process fills the rows
of its own virtual ranks and leaves the others at -0.0, IEEE's exact additive identity, so the
sum gives every row's bits whatever the backend's order — and the rows are divided by N (DDP's
own scaling) and added in virtual-rank order: the same bytes added in the same order whatever
the placement, so a job shrunk to fewer processes, or grown back, computes exactly the bits of
the fault-free elastic run (tests/runtime/test_virtual.py).

``VirtualRanks`` is itself the DDP module's gradient-exchange seam (runtime/ddp.py
``GradientExchange``), layered over the step protocol's under ``hotspare run`` (so the per-rank
rows, the health vote and a peer's failure work as for any step) and over plain
torch.distributed outside it; it is also a part of the rank's per-rank state
(runtime/rankstate.py): every virtual rank's state travels in its process's row, so a spare
that replaces a process restores the virtual ranks it runs.

What differs from plain DDP (and torchrun): the summation order of the reduction (a sequential
sum in virtual-rank order instead of gloo's or NCCL's ring), and each virtual rank's gradient
crosses the network whole (an all-reduce of N gradients instead of one). Supported: one ``job.ddp`` module, one backward per virtual rank per step, one optimizer
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

from hotspare.errors import ConfigError
from hotspare.runtime.ddp import wrap_ddp
from hotspare.runtime.loader import ResumableLoader

_RNG = torch.get_rng_state().numel()


class VirtualRanks:
    """N virtual ranks of one DDP model, the ones of ``placement`` (virtual -> physical rank)
    with this process's ``rank`` run here. ``make_loader(vrank, vworld)`` builds the DataLoader
    of one virtual rank (e.g. with ``DistributedSampler(ds, num_replicas=vworld, rank=vrank)``);
    virtual rank v's torch generator starts from ``torch.manual_seed(seed + v)``. ``model`` is
    the DDP module (``ddp_kwargs`` go to it); ``inner``: the step protocol under hotspare run."""

    name = "virtual"

    def __init__(self, module: torch.nn.Module, *, vworld: int, placement: Mapping[int, int], rank: int,
                 make_loader: Callable[[int, int], Any], seed: int = 0, group: Any = None, inner: Any = None,
                 **ddp_kwargs: Any):
        _check_kwargs(module, ddp_kwargs)
        if sorted(placement) != list(range(vworld)):
            raise ValueError(f"placement must give a process to each of the {vworld} virtual ranks, got {placement}")
        self.vworld, self.rank, self.group, self.seed, self.inner = vworld, rank, group, seed, inner
        self.make_loader = make_loader
        self.model = wrap_ddp(module, self, **ddp_kwargs)
        self.buffers = [b for b in module.buffers()]
        self.loaders: dict[int, ResumableLoader] = {}
        self.slots: dict[int, torch.Tensor] = {}        # virtual rank -> its per-rank state while not current
        self.current: int | None = None
        self._last = False
        self._live: torch.Tensor | None = None          # the current share's state, during the exchange
        self._outside: torch.Tensor | None = None       # the process's own generator state, during shares
        self._stash: dict[int, list[torch.Tensor]] = {}   # bucket index -> this step's raw gradients, in share order
        self._tables: list[tuple[torch.Tensor, torch.Tensor]] = []   # (bucket, [N, n] table) being exchanged
        self.placement: dict[int, int] = {}
        self.check: Callable[[], None] | None = None      # once, at the first share (virtual_ranks)
        self._set_placement(placement)
        outside = torch.get_rng_state()
        for v in self.held:
            torch.manual_seed(seed + v)
            self._loader(v)
            self.slots[v] = self.export_current(v)
        torch.set_rng_state(outside)
        self.slot_bytes = self.slots[self.held[0]].numel() if self.held else self._slot_size()
        self.nbytes = _RNG + vworld * self.slot_bytes

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

    def adopt(self, rank: int, placement: list[int], before: list[int] | None, prev_rank: int | None,
              table: torch.Tensor | None, offset: int) -> None:
        """Under hotspare run, after a generation's state sync: run ``placement`` as ``rank``.
        A virtual rank this process did not run in the generation ``before`` takes its state from
        ``table``, the per-rank rows of the committed step (row = its old process; this part at
        ``offset`` of each row)."""
        new = dict(enumerate(placement))
        if before is not None:
            if table is None:
                raise RuntimeError("an elastic job's placement changed but no per-rank rows of the committed "
                                   "step are held here")
            rows = table.view(len(set(before)), -1)
            for v in [v for v, p in new.items() if p == rank]:
                if prev_rank is None or before[v] != prev_rank:
                    at = offset + _RNG + v * self.slot_bytes
                    self.import_row(v, rows[before[v]][at:at + self.slot_bytes])
        self.rank = rank
        self._set_placement(new)
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

    def _slot_size(self) -> int:
        return _RNG + sum(b.numel() * b.element_size() for b in self.buffers) + 16 + _RNG

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

    # ------------------------------------------------------------------ a part of the rank's per-rank state
    def save(self) -> torch.Tensor:
        """The process's own generator, then every virtual rank's slot (zeros where another
        process runs it): the current share's as it is now."""
        out = torch.zeros(self.nbytes, dtype=torch.uint8)
        out[:_RNG].copy_(self._outside if self._outside is not None else torch.get_rng_state())
        for v in self.held:
            row = self._live if v == self.current and self._live is not None else \
                self.export_current(v) if v == self.current else self.slots[v]
            out[_RNG + v * self.slot_bytes:_RNG + (v + 1) * self.slot_bytes].copy_(row)
        return out

    def load(self, data: torch.Tensor) -> None:
        for v in self.held:
            self.import_row(v, data[_RNG + v * self.slot_bytes:_RNG + (v + 1) * self.slot_bytes])
        torch.set_rng_state(data[:_RNG].clone())

    # ------------------------------------------------------------------ a step
    def shares(self) -> Iterator[tuple[int, Any]]:
        """``for vrank, batch in vr.shares(): loss(model(batch)).backward()``: each virtual rank
        this process runs, with its state current and its next micro-batch. After the last one,
        the parameters' gradients are the virtual-rank-ordered mean of all N."""
        check, self.check = self.check, None
        if check is not None:
            check()
        self._outside = torch.get_rng_state()
        self._stash, self._tables, self._live = {}, [], None     # nothing left of a failed attempt
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
                    for p in self.model.module.parameters():
                        p.grad = None
        finally:
            self.current, self._live = None, None
            torch.set_rng_state(self._outside)
            self._outside = None
        if self._stash:
            stash, self._stash = self._stash, {}
            raise RuntimeError(f"virtual ranks: gradient buckets {sorted(stash)} were never exchanged "
                               "(a share without a backward through the DDP module?)")

    # ------------------------------------------------------------------ the gradient-exchange seam
    def reduce_bucket(self, index: int, buf: torch.Tensor):
        self._stash.setdefault(index, []).append(buf.clone())
        if not self._last:
            return None                    # kept; exchanged with the last share's
        mine = self._stash.pop(index)
        table = torch.full((self.vworld, buf.numel()), -0.0, dtype=buf.dtype)
        for v, g in zip(self.held, mine):
            table[v].copy_(g.reshape(-1))
        self._tables.append((buf, table))
        if self.inner is None:
            return dist.all_reduce(table, group=self.group, async_op=True) if self.processes > 1 else None
        if index == 0:
            # the rows gathered beside the buckets hold the process's own generator, not the share's
            self._live = self.export_current(self.current)
            torch.set_rng_state(self._outside)
            try:
                return self.inner.reduce_bucket(index, table.view(-1), scale=False)
            finally:
                torch.set_rng_state(self._live[:_RNG].clone())
        return self.inner.reduce_bucket(index, table.view(-1), scale=False)

    def finish_reduction(self, started: list, buffers: list[torch.Tensor]) -> BaseException | None:
        if not self._last:
            return None
        tables, self._tables = self._tables, []
        if self.inner is not None:
            error = self.inner.finish_reduction(started, [t.view(-1) for _, t in tables])
            if error is not None:
                return error
        else:
            for work in started:
                if work is not None:
                    work.wait()
        for buf, table in tables:
            buf.view(-1).copy_(self.mean(table))
        return None

    def broadcast_buffers(self, buffers) -> None:
        raise AssertionError("refused at construction: an elastic job's buffers are each virtual rank's own")

    def reduce_side(self, tensor: torch.Tensor):
        raise AssertionError("refused at construction: find_unused_parameters")

    def mean(self, table: torch.Tensor) -> torch.Tensor:
        """Every virtual rank's gradient divided by N, added in virtual-rank order."""
        out = table[0].div(self.vworld)
        for v in range(1, self.vworld):
            out.add_(table[v].div(self.vworld))
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


def _check_kwargs(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    if kwargs.get("find_unused_parameters"):
        raise ValueError("an elastic job's DDP cannot use find_unused_parameters=True (not supported yet)")
    if kwargs.get("broadcast_buffers", True) and any(True for _ in module.buffers()):
        raise ValueError("an elastic job keeps each virtual rank's buffers its own: pass broadcast_buffers=False")
    if kwargs.get("gradient_as_bucket_view"):
        raise ValueError("an elastic job's DDP cannot use gradient_as_bucket_view=True (not supported yet)")
    kwargs["broadcast_buffers"] = False


def require_virtual(placement: Any, parts: list) -> None:
    """``hotspare run --elastic`` with a script that does not train over ``job.virtual_ranks``: a
    shrink would change its global batch, so it is refused before the first step."""
    if placement is not None and not any(isinstance(p, VirtualRanks) for p in parts):
        raise ConfigError("hotspare run --elastic needs a script that trains over job.virtual_ranks(...) (a shrink "
                          "keeps the global batch by running the lost rank's virtual ranks on the survivors: "
                          "docs/CONTRACT.md, Elastic jobs); drop --elastic, or write the step loop over vr.shares()")


def virtual_ranks(job: Any, module: torch.nn.Module, make_loader: Callable[[int, int], Any], seed: int,
                  ddp_kwargs: dict[str, Any]) -> VirtualRanks:
    """``job.virtual_ranks``: the job's virtual ranks (one per process as it starts; under
    ``hotspare run --elastic``, the placement its generation was formed with)."""
    members = job.members if job.managed else None
    placement = members.placement if members is not None and members.placement else list(range(job.world_size))
    vr = VirtualRanks(module, vworld=len(placement), placement=dict(enumerate(placement)), rank=job.rank,
                      make_loader=make_loader, seed=seed, inner=job.protocol if job.managed else None,
                      **ddp_kwargs)
    job.rankstate.add_part(vr)
    job._ddps.append(vr.model)

    def check() -> None:
        scalers = [n for n, o in job.registry.objects().items()
                   if isinstance(o, torch.amp.GradScaler) and o.is_enabled()]
        if scalers:
            raise ConfigError(f"job.virtual_ranks: an enabled GradScaler ({', '.join(scalers)}) is not supported "
                              "yet (its unscale and inf check would see only the combined gradient); train in "
                              "float32 or bfloat16 without a scaler")
    vr.check = check

    def after_sync(msg: dict[str, Any]) -> None:
        before = msg.get("before")
        table = offset = None
        if before:
            # the committed step's rows as gathered (or as the source sent them): not the rows
            # the ranks publish at the top of an iteration, whose keys the new placement's
            # ranks reuse at once
            table = job.rows.rows_for(msg["target"])
            offset = 0
            for part in job.rankstate.layout():
                if part is vr:
                    break
                offset += part.nbytes
        vr.adopt(members.rank, msg.get("placement") or placement, before, members.prev_rank, table, offset or 0)

    if members is not None:
        members.after_sync.append(after_sync)
    return vr


__all__ = ["VirtualRanks", "virtual_ranks"]
