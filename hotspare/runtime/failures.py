"""A failed step: a peer's failure (recovered) or the script's own error (reported, fatal)?

Decided by where the exception came from, never by its message (a script's
``RuntimeError("DataLoader timed out")`` is the script's):

* a collective of hotspare's (gradient buckets, health vote, per-rank state rows, buffer
  broadcast, state transfer) failed: the runtime noted it where the future or call failed
  (``Collectives.note``);
* the generation's group was aborted (the coordinator saw a peer die);
* the exception is torch.distributed's own (``DistError``: store, backend, network) or
  hotspare's ``PeerFailure``;
* it was raised inside torch.distributed (the innermost frame of its traceback is there): a
  collective the script issued itself, e.g. an all-reduce of its loss for logging. gloo reports
  a dead peer as a plain ``RuntimeError`` from there. A script's misuse of a collective raised
  there too is recovered like a transient fault, and stopped as a bug when it repeats (the
  coordinator stops a job whose collectives keep failing with no worker lost).
"""
from __future__ import annotations

import os

import torch.distributed as dist

from hotspare.errors import PeerFailure

_DIST_DIR = os.path.dirname(dist.__file__) + os.sep


def raised_in_torch_distributed(ev: BaseException) -> bool:
    tb, last = ev.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and last.tb_frame.f_code.co_filename.startswith(_DIST_DIR)


class Collectives:
    """Where this step's communication failed, as noted by the code that ran it."""

    def __init__(self) -> None:
        self.error: str | None = None

    def note(self, e: BaseException) -> None:
        self.error = f"{type(e).__name__}: {str(e)[:300]}"

    def clear(self) -> None:
        self.error = None

    def is_peer_failure(self, ev: BaseException, group_aborted: bool) -> bool:
        if self.error is not None or group_aborted:
            return True
        if isinstance(ev, (PeerFailure, dist.DistError)):
            return True
        return isinstance(ev, RuntimeError) and raised_in_torch_distributed(ev)
