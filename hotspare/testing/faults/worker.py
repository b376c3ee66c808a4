"""The worker's half of fault injection (a testing plug-in; ``hotspare run --inject``).

Loaded by the runtime only when the launcher enabled injection (``HOTSPARE_FAULTS=1`` in the
worker environment contract). It reports the worker's fault triggers to its agent (a step's
start, joining a generation, a state transfer) and, while faults are armed (``watch``), waits
for the agent's ``go`` at each: an injected fault then lands exactly there (a SIGKILL at step 17
kills the rank in step 17, not a few steps later when the agent's thread got the CPU). It also
carries out, for real, the faults a worker does to itself: ``slow``, ``nan``, ``corrupt``, and
``exit_now`` (an abrupt exit from the control thread, as a crashing library would).
"""
from __future__ import annotations

import os
import queue
import sys
import threading
import time
from typing import Any, Callable

import torch

from hotspare.runtime.hooks import WorkerHooks
from hotspare.runtime.link import AgentLink

GO_TIMEOUT_S = 10.0      # longest wait for the agent at a trigger: the run matters more than the test


class FaultHooks(WorkerHooks):
    def __init__(self, link: AgentLink, params: Callable[[], list[torch.Tensor]], rank: Callable[[], int | None]):
        self.link, self._params, self._rank = link, params, rank
        self.watched = False                  # faults are armed somewhere: report steps, wait for go
        self._seq, self._go = 0, threading.Event()
        self._faults: "queue.Queue[dict[str, Any]]" = queue.Queue()
        self.slow = 1.0
        self._nan_pending = False
        link.on("watch", self._on_watch)
        link.on("go", self._on_go)
        link.on("fault", self._faults.put)
        link.on("exit_now", lambda msg: os._exit(msg["code"]))

    def _on_watch(self, msg: dict[str, Any]) -> None:
        self.watched = msg["steps"]

    def _on_go(self, msg: dict[str, Any]) -> None:
        if msg["wait"] == self._seq:
            self._go.set()

    def _trigger(self, type_: str, **fields: Any) -> None:
        if not self.watched:
            self.link.send(type_, **fields)
            return
        self._seq += 1
        self._go.clear()
        self.link.send(type_, wait=self._seq, **fields)
        if not self._go.wait(GO_TIMEOUT_S):
            print(f"hotspare: rank {self._rank()}: no answer from the agent to {type_!r} within "
                  f"{GO_TIMEOUT_S:.0f} s; going on", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ WorkerHooks
    def step_begins(self, gen: int, rank: int, step: int, total: int | None) -> None:
        while not self._faults.empty():
            self._apply(self._faults.get())
        if self.watched:     # a step boundary is a trigger only while a fault waits to fire
            self._trigger("step", gen=gen, rank=rank, step=step, total=total)

    def joining(self, gen: int, rank: int) -> None:
        self._trigger("joining", gen=gen, rank=rank)

    def transfer(self, gen: int, rank: int, role: str) -> None:
        self._trigger("transfer", gen=gen, rank=rank, role=role)

    def reduction_reached(self, compute_s: float) -> None:
        if self.slow > 1.0:     # `slow`: this worker really computes F times slower
            time.sleep((self.slow - 1.0) * compute_s)

    def bucket(self, flat: torch.Tensor) -> None:
        if self._nan_pending:   # `nan`: this rank's gradients of this step break
            self._nan_pending = False
            flat[0] = float("nan")

    def _apply(self, fault: dict[str, Any]) -> None:
        kind = fault["kind"]
        if kind == "slow":
            self.slow = float(fault["params"]["factor"])
        elif kind == "nan":
            self._nan_pending = True
        elif kind == "corrupt":
            # Flip the lowest mantissa bit of one parameter value: silent, tiny, and real.
            target = max(self._params(), key=lambda p: p.numel())
            with torch.no_grad():
                target.detach().view(-1).view(torch.int32)[0] ^= 1
        print(f"hotspare: rank {self._rank()}: injected {kind} {fault.get('params') or ''}".rstrip(),
              file=sys.stderr, flush=True)
