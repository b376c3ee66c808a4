"""Checks of a training script against the step contract (docs/CONTRACT.md), run by the job on
the script's own objects: what it built but did not say, caught as a clear error that says what
to change, before a failover could make the run silently differ.

* ``untracked_kinds``: at the first step, an LR scheduler or an enabled GradScaler on a tracked
  optimizer that is not tracked, and any optimizer that is not tracked;
* ``UntrackedWatch``: modules with parameters the script built and did not track (an EMA, a
  second model) are fingerprinted at the first step and again a few steps later; one that
  changed is training state a replacement would rebuild from scratch;
* ``LoaderGuard``: a DataLoader iterator that hands out batches in two different steps without
  ``job.loader`` (a re-run step would not get its batches again, a replacement would start its
  epoch over).

Each check looks only at replicated facts or at the rank's own loop, so every rank reaches the
same verdict at the same step: no rank is left waiting in a collective its peers abandoned.
"""
from __future__ import annotations

import gc
import hashlib
import warnings
from typing import Any, Callable

import torch

from hotspare.errors import ConfigError
from hotspare.runtime.objdigest import script_name

WATCH_STEPS = 3      # an untracked module is compared again this many steps after the first


def _name_of(obj: Any) -> str:
    """The script's name for ``obj`` (a variable of a ``__main__`` frame), or its type."""
    name = script_name(obj)
    return f"{type(obj).__name__} `{name}`" if name else f"an untracked {type(obj).__name__}"


def _heap(kinds: tuple[type, ...]) -> list[Any]:
    with warnings.catch_warnings():     # isinstance() on deprecated torch objects warns
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, kinds)]


def untracked_kinds(objects: dict[str, Any]) -> None:
    """Raise ConfigError for a scheduler, an enabled scaler or an optimizer left untracked."""
    tracked = {id(o) for o in objects.values()}
    optimizers = {id(o) for o in objects.values() if isinstance(o, torch.optim.Optimizer)}
    kinds = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau,
             torch.amp.GradScaler, torch.optim.Optimizer)
    for obj in _heap(kinds):            # one pass over the heap, once, at the job's start
        if id(obj) in tracked:
            continue
        if isinstance(obj, torch.amp.GradScaler):
            if obj.is_enabled():
                raise ConfigError("an enabled GradScaler is not tracked: a replacement would restart "
                                  "its loss scale; add it: job.track(scaler=...)")
        elif isinstance(obj, torch.optim.Optimizer):
            if any(p.requires_grad for g in obj.param_groups for p in g["params"]):
                raise ConfigError(f"{_name_of(obj)} is not tracked: a replacement would start it with empty "
                                  "state (momentum, Adam's moments, its step count); add it: job.track(...)")
        elif id(getattr(obj, "optimizer", None)) in optimizers:
            raise ConfigError(f"a {type(obj).__name__} on the tracked optimizer is not tracked: a "
                              "replacement would restart it; add it: job.track(scheduler=...)")


def _module_sum(m: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for t in list(m.parameters()) + list(m.buffers()):
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


class UntrackedWatch:
    """Modules with parameters that no tracked object holds, watched for a few steps."""

    def __init__(self, objects: dict[str, Any], first_step: int) -> None:
        held: set[int] = set()
        for o in objects.values():
            if isinstance(o, torch.nn.Module):
                held.update(id(m) for m in o.modules())
                held.update(id(p) for p in o.parameters())
        candidates = [m for m in _heap((torch.nn.Module,))
                      if id(m) not in held and not isinstance(m, torch.nn.parallel.DistributedDataParallel)]
        # only the outermost untracked modules, and only those with parameters of their own
        inner = {id(c) for m in candidates for c in m.modules() if c is not m}
        self.watched = [(m, _module_sum(m)) for m in candidates if id(m) not in inner
                        and any(id(p) not in held for p in m.parameters())]
        self.at = first_step + WATCH_STEPS

    def check(self, step: int) -> bool:
        """At the top of step ``step``: raise for a watched module that changed; True when done."""
        if step < self.at:
            return False
        for m, digest in self.watched:
            if _module_sum(m) != digest:
                raise ConfigError(f"{_name_of(m)} changed during the first {WATCH_STEPS} steps but is not tracked: "
                                  "a replacement would rebuild it from the script and the run would silently "
                                  "differ; pass it to job.track(...) (an EMA, a second model and its optimizer)")
        self.watched = []
        return True


class LoaderGuard:
    """Notes which step each DataLoader iterator hands batches to; one that is not a
    ``job.loader``'s and serves two different steps is refused."""

    def __init__(self, current_step: Callable[[], int], fail: Callable[[ConfigError], None]) -> None:
        self._step, self._fail = current_step, fail

    def install(self) -> None:
        from torch.utils.data import dataloader
        cls = dataloader._BaseDataLoaderIter
        if getattr(cls.__next__, "_hotspare", False):
            return
        original, guard = cls.__next__, self

        iterable = dataloader._DatasetKind.Iterable

        def __next__(it):
            # An IterableDataset's stream is its own (its position: a tracked generator)
            if not getattr(it, "_hotspare_resumable", False) and getattr(it, "_dataset_kind", None) != iterable:
                guard.served(it)
            return original(it)
        __next__._hotspare = True
        cls.__next__ = __next__

    def served(self, it: Any) -> None:
        step = self._step()
        first = getattr(it, "_hotspare_first_step", None)
        if first is None:
            it._hotspare_first_step = first = step     # on the iterator: ids are reused
        if first != step:
            it._hotspare_resumable = True              # said once
            self._fail(ConfigError(
                f"a DataLoader is iterated across steps ({first} and {step}) without job.loader: a re-run step "
                "would not get its batches again and a replacement would start the epoch over. Wrap it: "
                "loader = job.loader(DataLoader(...))"))


__all__ = ["untracked_kinds", "UntrackedWatch", "LoaderGuard"]
