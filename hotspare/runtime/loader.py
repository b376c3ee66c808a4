"""``job.loader(DataLoader(...))``: a DataLoader that fails over exactly.

A failover touches a data stream in two ways:

* a survivor that re-runs step k has already taken step k's batches from its iterator: it must
  get the same batches again, and then go on where its iterator is;
* a replacement starts with no iterator at all: it must resume its predecessor's stream at the
  committed position, with the same samples in the same order, the same loader-worker seeds and
  the same random augmentations.

The wrapper keeps the batches handed out since the last commit and hands them out again after a
rollback. Its position (epoch, batches consumed in that epoch, and torch's generator state just
before the epoch's iterator was made) is per-rank state (runtime/rankstate.py): a replacement
rebuilds the epoch's iterator from that generator state — so ``DataLoader``'s base seed, a
``RandomSampler``'s permutation and every loader worker's seed come out as they did — and skips
the batches already consumed. Skipping loads and discards them (in the loader's workers when it
has some): slower than seeking, but exact for any dataset, collate function and augmentation.

Two ways to iterate, both resumable:

    for epoch in job.epochs(E):          # the epoch loop resumes at the committed epoch
        loader.sampler.set_epoch(epoch)  # as with any DistributedSampler
        for x, y in loader:
            with job.step():
                ...

    for step in job.steps(total):        # or a flat loop: next() runs through epochs by itself
        with step:
            x, y = next(loader)          # (and calls sampler.set_epoch(epoch) for you)
"""
from __future__ import annotations

import struct
from typing import Any, Callable, Iterator

import torch

from hotspare.errors import ConfigError

_RNG_BYTES = torch.get_rng_state().numel()


class ResumableLoader:
    """Iterate like the wrapped DataLoader; resumes exactly after a failover. The job's side:
    ``synced()`` before the first batch (a replacement takes its position first), ``epoch()``
    (the epoch of ``job.epochs``, or None), ``resume_point(capture)`` as the loop takes the next
    step's batch (the top of a loop iteration: runtime/iteration.py)."""

    def __init__(self, loader: Any, name: str, *, synced: Callable[[], None],
                 epoch: Callable[[], int | None], resume_point: Callable[[bool], None]):
        if getattr(loader, "persistent_workers", False):
            raise ConfigError("job.loader(): persistent_workers=True keeps loader workers (and their random "
                              "state) across epochs, which a replacement cannot reproduce; drop it")
        try:
            len(loader)
        except TypeError:
            raise ConfigError("job.loader() needs a loader with a length (a map-style dataset): a replacement "
                              "finds its place in the epoch by counting batches. For an IterableDataset, draw its "
                              "data from a torch.Generator given to job.track (as examples/mlp_accum.py does) and "
                              "iterate it without job.loader, in the main process (num_workers=0)") from None
        self.loader = loader
        self.name = name
        self.nbytes = 16 + _RNG_BYTES
        self._synced, self._job_epoch, self._resume_point = synced, epoch, resume_point
        self._epoch = 0
        self._consumed = 0          # batches of this epoch handed to the script (after rollbacks)
        self._pulled = 0            # batches of this epoch taken from the live iterator
        self._kept: dict[int, Any] = {}   # index in epoch -> batch, since the last commit
        # index -> torch's generator state before and after taking that batch, when taking it
        # drew from it (making the epoch's iterator, a RandomSampler's first index): handing the
        # batch out again must leave the generator where taking it did.
        self._draws: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._before: torch.Tensor | None = None   # the state before this epoch's iterator was made
        self._mark = 0              # position of this epoch at the last commit (rollbacks go back there)
        self._iter_rng = torch.get_rng_state()
        self._it: Iterator | None = None
        self._started = False
        self._restored = False      # the position came from another process (a replacement)
        self._stream: Iterator | None = None

    # ------------------------------------------------------------------ the script's side
    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    @property
    def batch_sampler(self) -> Any:
        return self.loader.batch_sampler

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        """One epoch (the job's current epoch under ``job.epochs``)."""
        self._synced()
        if self._job_epoch() is not None:
            epoch = self._job_epoch()
        elif self._restored:
            raise ConfigError(f"loader {self.name!r} resumed in epoch {self._epoch} on a replacement, but the "
                              "script's epoch loop is its own: write it `for epoch in job.epochs(n)` so a "
                              "replacement skips the epochs already done")
        else:
            epoch = self._epoch + 1 if self._started else 0
        return self._run_epoch(epoch)

    def __next__(self) -> Any:
        """The next batch of an endless stream of epochs (sets the sampler's epoch itself)."""
        self._synced()
        while True:
            if self._stream is None:
                epoch = self.next_epoch()
                set_epoch = getattr(self.loader.sampler, "set_epoch", None)
                if callable(set_epoch):
                    set_epoch(epoch)
                self._stream = self._run_epoch(epoch)
            try:
                return next(self._stream)
            except StopIteration:
                self._stream = None
                self._started = True
                self._epoch += 1
                self._it = None
                self._pulled = self._consumed = self._mark = 0
                self._kept.clear()
                self._draws.clear()
                # the next epoch starts on the next call, from the generator state at that moment

    # ------------------------------------------------------------------ epochs
    def _resumable(self, epoch: int) -> bool:
        """A restored position inside ``epoch`` that no live iterator holds yet."""
        return self._it is None and self._started and epoch == self._epoch and 0 < self._consumed < len(self.loader)

    def _run_epoch(self, epoch: int) -> Iterator:
        if self._started and epoch < self._epoch:
            raise ConfigError(f"loader {self.name!r} is asked for epoch {epoch} but has resumed in epoch "
                              f"{self._epoch}: drive the epoch loop with `for epoch in job.epochs(n)` so a "
                              "replacement skips the epochs already done")
        if self._resumable(epoch):
            self._fast_forward()
        elif not (self._it is not None and epoch == self._epoch):
            self._epoch, self._consumed, self._pulled, self._mark = epoch, 0, 0, 0
            self._kept.clear()
            self._draws.clear()
            self._iter_rng = self._before = torch.get_rng_state()
            self._it = _mark(iter(self.loader))
        self._started = True
        return self._batches()

    def _fast_forward(self) -> None:
        """A replacement's first iterator: made from the generator state its predecessor's was
        made from, then moved past the batches already consumed (loaded and dropped)."""
        current = torch.get_rng_state()
        torch.set_rng_state(self._iter_rng)
        try:
            self._it = _mark(iter(self.loader))
            for _ in range(self._consumed):
                next(self._it)
        finally:
            torch.set_rng_state(current)
        self._pulled = self._mark = self._consumed
        self._kept.clear()
        self._draws.clear()
        self._before = None
        self._restored = False

    def _batches(self) -> Iterator:
        it = self._it
        while True:
            # Between steps (a no-op inside one): undo a failed attempt's iteration and recover
            # before choosing the batch; at an epoch's first batch the iteration's top was noted
            # before the epoch's iterator was made (job.epochs).
            self._resume_point(self._consumed > 0)
            if self._it is not it:          # the position was moved to another epoch (a restore)
                return
            i = self._consumed
            if i < self._pulled:            # re-run after a rollback: the same batch again
                batch = self._kept[i]
                draw = self._draws.get(i)
                if draw is not None and torch.equal(torch.get_rng_state(), draw[0]):
                    torch.set_rng_state(draw[1])
            else:
                before = self._before if self._before is not None else torch.get_rng_state()
                self._before = None
                try:
                    batch = next(it)
                except StopIteration:
                    return
                after = torch.get_rng_state()
                if not torch.equal(before, after):
                    self._draws[i] = (before, after)
                self._pulled += 1
                self._kept[i] = batch
            self._consumed = i + 1
            yield batch

    # ------------------------------------------------------------------ the job's side
    def committed(self) -> None:
        """A step committed: batches before the current position are never needed again."""
        self._mark = self._consumed
        for i in [i for i in self._kept if i < self._consumed]:
            del self._kept[i]
            self._draws.pop(i, None)

    def rollback(self) -> None:
        """A step is re-run on this rank: hand out again what was taken since the last commit."""
        if self._it is not None:
            self._consumed = self._mark

    def save(self) -> torch.Tensor:
        head = torch.frombuffer(bytearray(struct.pack("<qq", self._epoch, self._consumed)), dtype=torch.uint8)
        return torch.cat([head, self._iter_rng])

    def load(self, data: torch.Tensor) -> None:
        epoch, consumed = struct.unpack("<qq", data[:16].numpy().tobytes())
        iter_rng = data[16:].clone()
        if self._it is not None and epoch == self._epoch and consumed <= self._pulled \
                and all(i in self._kept for i in range(consumed, self._pulled)):
            self._consumed = consumed       # a rollback on a survivor: hand the kept batches out again
            return
        # Another position (a replacement, or a survivor brought to another rank's step): the next
        # iteration of this epoch is rebuilt from the generator state and fast-forwarded.
        self._epoch, self._consumed, self._iter_rng = epoch, consumed, iter_rng
        self._it, self._stream, self._pulled, self._mark = None, None, 0, consumed
        self._kept.clear()
        self._draws.clear()
        self._started = self._restored = True

    def next_epoch(self) -> int:
        """The epoch a replacement's epoch loop should start at."""
        if not self._started:
            return 0
        return self._epoch + (1 if self._consumed >= len(self.loader) else 0)


def _mark(it: Iterator) -> Iterator:
    """An iterator of ours: the loader guard (runtime/contract.py) leaves it alone."""
    try:
        it._hotspare_resumable = True
    except AttributeError:
        pass
    return it
