"""The in-process runtime: one ``Job`` per training process.

The step protocol, from the training script's point of view::

    job = hotspare.init()                   # a spare waits here until it takes a rank
    model = job.ddp(model)
    job.track(model=model, optimizer=opt, scheduler=sched)
    for step in job.steps(total):           # or: for epoch in job.epochs(n): for b in loader:
        with step:                          #                                   with job.step():
            ...                             # a failure inside is recovered, at the committed step

Commit semantics (docs/CONTRACT.md): a step is committed on a rank when its ``with`` block
finished: its optimizer stepped after a successful gradient reduction, and every rank's per-rank
state of the step was gathered beside that reduction (runtime/rankstate.py). A failure anywhere
in a step leaves each survivor at step k or k-1; it puts back what the failed attempt touched
(generators, buffers, data position, gradients), tears its generation down (which frees the
peers still blocked in a collective), reports its committed step and waits. The coordinator
forms the next generation with a spare in the dead rank's place; the most advanced survivor
sends the replicated state and every rank's per-rank row; everyone resumes at the step after it.
Nothing is reloaded from disk.

An exception that is not a communication failure is the script's own: it is reported with its
traceback and the process dies, like any crash. If a replacement fails the same step again the
coordinator stops the job and says it looks like a bug.

Outside ``hotspare run`` (plain ``torchrun`` or ``python``) the same calls fall back to plain
torch.distributed and DDP, so scripts can adopt hotspare gradually.
"""
from __future__ import annotations

import atexit
import dataclasses
import faulthandler
import gc
import json
import math
import os
import queue
import signal
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist

from hotspare.errors import ConfigError, JobFailed, PeerFailure, ProtocolError, StateMismatch, StateTrackingError
from hotspare.pg import GenerationGroup
from hotspare.protocol.auth import worker_connect
from hotspare.protocol.channel import Channel
from hotspare.protocol.messages import make
from hotspare.runtime.loader import ResumableLoader
from hotspare.runtime.persist import Persister
from hotspare.runtime.rankstate import GradState, RankState, RowTable
from hotspare.runtime.state import StateRegistry
from hotspare.runtime.vote import HealthFault, VoteResult, fingerprint, nonfinite_verdict, row, scale_and_check, tally, word_views
from hotspare.transfer import broadcast_state

ENV_AGENT = "HOTSPARE_AGENT"          # host:port of the node agent; its presence means "managed"
ENV_WORKER = "HOTSPARE_WORKER_ID"
ENV_ROLE = "HOTSPARE_ROLE"            # "active" or "spare"
ENV_JOIN_TIMEOUT = "HOTSPARE_JOIN_TIMEOUT"   # seconds to form a generation's group
ENV_FINGERPRINT_EVERY = "HOTSPARE_FINGERPRINT_EVERY"   # steps between health votes (0: no fingerprint)
GO_TIMEOUT_S = 10.0                     # longest wait for the agent at a fault trigger
COMMITS_HELD, COMMITS_HELD_S = 8, 5.0   # a rank > 0 batches its commit reports (see _report_commit)
DEFAULT_VOTE_EVERY = 10   # steps between health votes; see runtime/vote.py for the trade-off
# Outside hotspare run, rank 0's job.log prints at most this often (and at the last step);
# HOTSPARE_LOG_EVERY_S overrides it (0: every step, as bench/overhead.py needs).
ENV_LOG_EVERY_S = "HOTSPARE_LOG_EVERY_S"
PLAIN_LOG_EVERY_S = 10.0

# Messages gloo/NCCL/c10d put in the errors of a broken collective.
_COMM_MARKERS = ("gloo/transport", "nccl", "connection reset", "connection closed",
                 "connection refused", "broken pipe", "timed out", "read error", "write error")


class Step(int):
    """A step number that is also the context manager guarding that step."""

    _job: "Job"

    def __new__(cls, job: "Job", value: int) -> "Step":
        obj = super().__new__(cls, value)
        obj._job = job
        return obj

    def __enter__(self) -> "Step":
        self._job._enter_step(int(self))
        return self

    def __exit__(self, et, ev, tb) -> bool:
        return self._job._exit_step(int(self), ev)


class _NextStep:
    """``with job.step():`` -- the next step, for loops the script drives itself (over a
    ``job.loader``). A failure inside is recovered before the block is left: the loop's next
    batch is the failed step's batch again, and the next ``job.step()`` re-runs the step."""

    def __init__(self, job: "Job"):
        self._job = job
        self._step: int | None = None

    def __enter__(self) -> int:
        self._step = self._job._begin_context_step()
        self._job._enter_step(self._step)
        return self._step

    def __exit__(self, et, ev, tb) -> bool:
        swallowed = self._job._exit_step(self._step, ev)
        if swallowed:
            self._job._recover_now()
        return swallowed


class Job:
    """Rank, world size, tracked state and the step loop of one training process."""

    def __init__(self) -> None:
        self.managed = ENV_AGENT in os.environ
        self.rank: int | None = None
        self.world_size: int = 1
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.generation = 0
        self.committed = -1                 # last committed step on this rank
        self.registry = StateRegistry()
        self._applied = -1                  # last step whose optimizer update is in the state
        self._current: int | None = None
        self._step_t0 = 0.0
        self._metrics: dict[str, float] = {}
        self._failure: str | None = None    # a peer failure seen in this step
        self._comm_error: str | None = None
        self._group: GenerationGroup | None = None
        self._pending_sync: dict[str, Any] | None = None
        self._failed_step: int | None = None   # the step whose failure is being recovered
        self._staged: tuple[dict[str, Any], list[torch.Tensor], torch.Tensor | None] | None = None
        self._inbox: "queue.Queue[dict[str, Any]]" = queue.Queue()
        self._channel: Channel | None = None
        self._store: dist.Store | None = None
        self._total: int | None = None        # job.steps(total); None under job.epochs / job.step
        self._ddps: list[torch.nn.Module] = []
        self.step_times: list[float] = []   # seconds per committed step on this rank
        self._reducing_step: int | None = None
        self._watched = False                # the agent wants a message as each step begins
        self._wait_seq, self._go = 0, threading.Event()   # ... and answers it (see _trigger)
        self._aborted_upto = 0               # newest generation the coordinator aborted
        self._persist = Persister(self.registry, on_done=self._report_checkpoint)
        # In-process health signals (see runtime/vote.py).
        self.fingerprint_every = int(os.environ.get(ENV_FINGERPRINT_EVERY, DEFAULT_VOTE_EVERY))
        self._params: list[torch.Tensor] | None = None   # integer views for the fingerprint
        self._nonfinite: torch.Tensor | None = None   # > 0 once this step's own gradients held NaN/Inf
        self._reported_gen = -1        # the generation whose first commit was reported
        self._inflight: list = []                     # this backward's bucket all-reduces (runtime/ddp.py)
        self._buckets: list[torch.Tensor] = []        # ... once reduced: their sentinels are read before the update
        self._vote: torch.futures.Future | None = None   # this step's vote, in flight since the step began
        self._health: VoteResult | None = None   # this step's failed vote
        self._exchange_t: float | None = None    # when this step reached the gradient exchange
        self._pause_gen = -1                     # a live migration asked this generation to pause
        self._pause_at: int | None = None        # ... after this step (agreed by the vote)
        self._faults: "queue.Queue[dict[str, Any]]" = queue.Queue()   # injected worker faults
        self._slow = 1.0
        self._nan_pending = False
        self._check_s = self._check_cpu = self._fp_s = 0.0
        self._voting: tuple[int, bool] = (-1, False)   # (step, with fingerprint) of the vote in flight
        # Per-rank state (runtime/rankstate.py): captured as each step begins (a re-run restores
        # it), gathered from every rank while the gradients are reduced (a replacement receives
        # its predecessor's row).
        self.rankstate = RankState()
        self.grads = GradState()
        self.loaders: list[ResumableLoader] = []
        self.epoch: int | None = None          # the epoch under job.epochs()
        self._entry: tuple[int, torch.Tensor, list[int]] | None = None   # (step, state, grads) as it began
        self._entry_buf: torch.Tensor | None = None
        self.rows = RowTable(self.rankstate)   # every rank's per-rank state of the last steps
        self._verify_at = -1                   # the step whose vote checks a state transfer
        self._tracking: str | None = None      # ... and what it found
        self._checked_tracking = False
        self._last_print = 0.0
        self._print_every = float(os.environ.get(ENV_LOG_EVERY_S, PLAIN_LOG_EVERY_S))

    # ------------------------------------------------------------------ set-up
    def _init(self) -> None:
        if not self.managed:
            self._init_plain()
            return
        self.worker = os.environ[ENV_WORKER]
        self.role = os.environ.get(ENV_ROLE, "active")
        # Before the coordinator fences this worker it sends SIGUSR1: every thread's stack goes
        # to stderr, so a fence says where the worker was.
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
        self._channel = worker_connect(os.environ[ENV_AGENT], self.worker, self.role)   # says hello
        threading.Thread(target=self._read_control, name="hotspare-control", daemon=True).start()
        self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                    is_master=False, timeout=_timedelta(300), wait_for_workers=False)
        if self.role == "active":
            self.rank = int(os.environ["RANK"])
            self.world_size = int(os.environ["WORLD_SIZE"])
        # A spare waits here until it takes a rank: the script's code after init() runs only
        # with the rank, world size and process group it trains with, as under torchrun.
        self._channel.send(make("ready", worker=self.worker, committed=self.committed))
        msg = self._await_generation()
        if msg is None:
            if self.role == "spare":      # released unused: the job is done without us
                atexit._run_exitfuncs()   # what the script registered before init() still runs
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            raise JobFailed("the coordinator released this worker before the job started")
        self._join_until_ok(msg)

    def _init_plain(self) -> None:
        if not dist.is_initialized():
            if "WORLD_SIZE" in os.environ:
                backend = "nccl" if torch.cuda.is_available() else "gloo"
                dist.init_process_group(backend)
            else:  # plain `python script.py`: a world of one
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    # ------------------------------------------------------------------ user API
    def ddp(self, module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        """Wrap ``module`` in DistributedDataParallel whose reduction survives failovers."""
        from hotspare.runtime.ddp import wrap_ddp
        ddp = wrap_ddp(module, self, **kwargs)
        self._ddps.append(ddp)
        return ddp

    def track(self, **objects: Any) -> None:
        """Register what a replacement must receive: ``job.track(model=m, optimizer=opt,
        scheduler=sched, scaler=scaler)``. Anything with ``state_dict()``/``load_state_dict()``
        is replicated state (the same on every rank); a ``torch.Generator`` is per-rank state
        (each rank's own stream, replicated to its peers at every step). A model's buffers are
        per-rank too: under DDP each rank's BatchNorm statistics are its own.

        The same state goes into persistent checkpoints when the launcher asks for them."""
        if not objects:
            raise ConfigError("job.track() needs at least one name=object, e.g. job.track(model=model, optimizer=opt)")
        for name, obj in objects.items():
            if isinstance(obj, torch.Generator):
                self.rankstate.add_generator(name, obj)
                continue
            self.registry.add(name, obj)
            module = self.registry.objects()[name]
            if isinstance(module, torch.nn.Module):
                self.rankstate.add_module(name, module)
                self.grads.add(module.parameters())
            if isinstance(obj, torch.optim.Optimizer):
                self.grads.add(p for group in obj.param_groups for p in group["params"])
                obj.register_step_pre_hook(self._before_optimizer_step)
                obj.register_step_post_hook(self._on_optimizer_step)

    def loader(self, loader: Any, name: str | None = None) -> ResumableLoader:
        """Wrap a ``DataLoader`` (with a ``DistributedSampler``, workers, collate, transforms) so
        that a failover resumes it exactly: a re-run step gets its batches again, a replacement
        continues its predecessor's stream. See runtime/loader.py."""
        wrapped = ResumableLoader(self, loader, name or f"loader{len(self.loaders)}")
        self.loaders.append(wrapped)
        self.rankstate.add_part(wrapped)
        return wrapped

    def log(self, **metrics: float) -> None:
        """Attach metrics (e.g. ``loss=loss.item()``) to this step's progress report."""
        for k, v in metrics.items():
            v = float(v)
            self._metrics[k] = v if math.isfinite(v) else str(v)   # JSON has no NaN

    def epochs(self, total: int) -> Iterator[int]:
        """``for epoch in job.epochs(n)``: the epochs still to run. A replacement starts at its
        predecessor's epoch (from its ``job.loader`` positions), so code between epochs (an
        evaluation, a per-epoch scheduler step) runs once per epoch on every rank, failover or not."""
        if not isinstance(total, int) or total < 0:
            raise ConfigError(f"job.epochs(total) needs a non-negative int, got {total!r}")
        self._require_tracked("job.epochs()")
        self.ensure_synced()
        start = max((l.next_epoch() for l in self.loaders), default=0)
        for epoch in range(start, total):
            self.epoch = epoch
            yield epoch
        self.epoch = None
        self._finish_all()

    def step(self) -> _NextStep:
        """``with job.step():`` guards the next step of a loop the script drives itself, e.g.
        ``for x, y in loader: with job.step(): ...``; the block's value is the step number."""
        self._require_tracked("job.step()")
        if self.managed and self.epoch is None:
            raise ConfigError("with job.step(): drive the loop around it with `for epoch in job.epochs(n)` "
                              "(a replacement resumes its epoch there, and the job ends when it ends), "
                              "or use `for step in job.steps(total): with step:`")
        return _NextStep(self)

    def steps(self, total: int) -> Iterator[Step]:
        """Yield the steps still to run, ``committed + 1 .. total - 1``, recovering as needed.
        Every rank must pass the same ``total``."""
        if not isinstance(total, int) or total < 0:
            raise ConfigError(f"job.steps(total) needs a non-negative int, got {total!r}")
        self._require_tracked("job.steps()")
        self._total = total
        if not self.managed:
            yield from self._plain_steps(total)
            return
        self.ensure_synced()
        while True:
            if self._failure is not None:
                self._recover()
                continue
            step = self.committed + 1
            if step >= total:
                if self._finish():
                    return
                continue
            if self._pause_at is not None and self.committed >= self._pause_at:
                self._pause()
                continue
            yield Step(self, step)

    def _require_tracked(self, what: str) -> None:
        if not self.registry:
            raise ConfigError(f"call job.track(model=..., optimizer=...) before {what}: "
                              "hotspare must know which state a spare receives")

    def ensure_synced(self) -> None:
        """Before the first step: take the state this rank was given when it joined (deferred
        until the script has built and tracked its objects), and check what is tracked."""
        if not self.managed:
            return
        if not self._checked_tracking:
            self._checked_tracking = True
            if self.role == "active":    # the job's first ranks check; a replacement runs the
                self._check_tracking()   # same script and must not spend its take-over on it
        if self._staged is not None:
            self._guarded(self._apply_staged)
        if self._pending_sync is not None:
            self._guarded(self._sync_state, self._pending_sync)
        while self._failure is not None:
            self._recover()

    def _check_tracking(self) -> None:
        """State hotspare must know about but was not told of: a clear error now, instead of a
        replacement that silently differs (and a health vote that blames the hardware)."""
        tracked = {id(o) for o in self.registry.objects().values()}
        optimizers = {id(o) for o in self.registry.objects().values() if isinstance(o, torch.optim.Optimizer)}
        kinds = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau,
                 torch.amp.GradScaler)
        with warnings.catch_warnings():     # isinstance() on deprecated torch objects warns
            warnings.simplefilter("ignore")
            found = [o for o in gc.get_objects() if isinstance(o, kinds) and id(o) not in tracked]
        for obj in found:                   # one pass over the heap, once, at the job's start
            if isinstance(obj, torch.amp.GradScaler):
                if obj.is_enabled():
                    raise ConfigError("an enabled GradScaler is not tracked: a replacement would restart "
                                      "its loss scale; add it: job.track(scaler=...)")
            elif id(getattr(obj, "optimizer", None)) in optimizers:
                raise ConfigError(f"a {type(obj).__name__} on the tracked optimizer is not tracked: a "
                                  "replacement would restart it; add it: job.track(scheduler=...)")

    def _plain_steps(self, total: int) -> Iterator[Step]:
        if self.world_size > 1:     # every rank must run the same steps (a mismatch hangs DDP)
            totals = torch.tensor([total, -total], dtype=torch.int64)
            dist.all_reduce(totals, op=dist.ReduceOp.MAX)
            if int(totals[0]) != -int(totals[1]):
                raise ConfigError(f"ranks disagree on job.steps(total): this rank has {total}, "
                                  f"others between {-int(totals[1])} and {int(totals[0])}")
        for step in range(self.committed + 1, total):
            yield Step(self, step)
        self._finish_all()

    def _finish_all(self) -> None:
        """The last step is done: report it (managed), or wait for every rank (plain)."""
        if self.managed:
            if self.rank == 0:
                self._persist.flush()      # a checkpoint in flight reports itself when durable
            while not self._finish():
                pass
        elif self.world_size > 1:
            dist.barrier()

    @property
    def digest(self) -> str:
        """sha256 of the replicated state (every tracked tensor but the modules' buffers, and
        the JSON metadata) in a canonical order: the same on every healthy replica."""
        return self.registry.digest(per_rank=self.rankstate.buffer_names())

    @property
    def rank_digest(self) -> str:
        """sha256 of this rank's per-rank state (generators, buffers, data position)."""
        return self.rankstate.digest(self.rankstate.capture())

    # ------------------------------------------------------------------ step protocol
    def _enter_step(self, step: int) -> None:
        self._current = step
        self._comm_error = None
        self._nonfinite, self._health, self._exchange_t = None, None, None
        self._inflight, self._buckets = [], []
        self._check_s = 0.0      # this step's health checks on this rank (NaN scan, fingerprint)
        self._check_cpu = 0.0    # ... their CPU time (the wall time above includes waiting for a core)
        self._fp_s = 0.0         # ... of which the parameter fingerprint
        while not self._faults.empty():
            self._apply_fault(self._faults.get())
        self._step_t0 = time.perf_counter()
        if self.managed:
            if self._watched:    # a fault is armed somewhere: the agent triggers it on step boundaries
                self._trigger("step", gen=self.generation, rank=self.rank, step=step, total=self._total)
            # The state a re-run of this step starts from (grads: which are None, which zero).
            self._entry_buf = self.rankstate.capture(self._entry_buf)
            self._entry = (step, self._entry_buf, self.grads.mask())
            self.rows.drop_inflight()
            self._start_vote(step)

    def _on_optimizer_step(self, *_: Any) -> None:
        if self._current is not None:
            self._applied = self._current

    def _exit_step(self, step: int, ev: BaseException | None) -> bool:
        self._current = None
        if ev is None and self._vote is not None:
            ev = self._settle_vote()     # a step without a DDP backward: judge its vote here
        self._vote = None
        if ev is None and self.managed:
            ev = self._settle_rows(step)
        if ev is None:
            self.committed = self._applied = step
            self._entry = None
            for loader in self.loaders:
                loader.committed()
            now = time.perf_counter()
            dt = now - self._step_t0
            self.step_times.append(dt)
            if self.managed:
                exch = self._exchange_t if self._exchange_t is not None else now
                self._report_commit(make("commit", gen=self.generation, rank=self.rank, step=step,
                                         total=self._total, dt=dt, metrics=self._metrics, compute=exch - self._step_t0,
                                         comm=now - exch, check=self._check_s, check_cpu=self._check_cpu,
                                         fp=self._fp_s))
                if self.rank == 0:
                    self._persist.after_commit(step)      # a finished write reports itself
            elif self.rank == 0 and self._metrics and (
                    now - self._last_print >= self._print_every or step + 1 == self._total):
                self._last_print = now
                print(f"step {step} " + " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in self._metrics.items())
                      + f" | {dt * 1000:.0f} ms", flush=True)
            self._metrics = {}
            return False
        if not self.managed or not isinstance(ev, Exception):
            return False
        if self._tracking is not None:
            self._report_crash(step, StateTrackingError(self._tracking))
            raise StateTrackingError(self._tracking) from ev
        if self._health is not None:
            # The vote failed on every rank alike, before any optimizer stepped: nobody is
            # blocked, the step is simply not committed; the suspect is replaced.
            self._failure = f"health vote: {self._health.detail}"
            self._failed_step = step
            return True
        if self._is_peer_failure(ev):
            # The optimizer may have stepped before a later collective of the block failed.
            self.committed = max(self.committed, self._applied)
            self._failure = f"{type(ev).__name__}: {str(ev).splitlines()[0][:300]}"
            self._failed_step = step
            if self._group is not None:
                self._group.abort()     # free the peers blocked on us now, not at teardown
            return True
        self._report_crash(step, ev)
        return False

    # ------------------------------------------------------------------ per-rank state rows
    def begin_gather(self) -> None:
        """Called as this step's gradient reduction starts (the DDP hook's first bucket): gather
        every rank's per-rank state beside the reduction (RowTable)."""
        if self._current is None or self._generation_broken():
            return
        try:
            self.rows.begin(self._group, self.world_size, self._current)
        except Exception as e:
            self._note_comm_error(e)
            raise

    def finish_gather(self) -> None:
        """Wait for the rows (called before any optimizer steps)."""
        try:
            self.rows.finish()
        except Exception as e:
            self._note_comm_error(e)
            raise

    def _settle_rows(self, step: int) -> BaseException | None:
        """At the end of a step: the rows must hold this rank's state as it commits."""
        try:
            self._check_generation()
            self.rows.settle(self._group, self.world_size, step)
        except Exception as e:
            self._note_comm_error(e)
            return e
        return None

    def _rollback(self, failed_step: int | None) -> None:
        """A step failed on this rank: put back what it touched (the step contract)."""
        entry, self._entry = self._entry, None
        if entry is None or failed_step is None or entry[0] != failed_step:
            return
        step, blob, mask = entry
        if self._applied >= step:
            # The optimizer stepped before a later collective of the block failed: the update
            # stands; whatever the rest of the block would have cleared, gradients are zero.
            self.grads.reset(self.grads.mask())
            for loader in self.loaders:
                loader.committed()
            return
        self.rankstate.restore(blob)
        self.grads.reset(mask)
        for loader in self.loaders:
            loader.rollback()

    # ------------------------------------------------------------------ context steps (job.step())
    def _begin_context_step(self) -> int:
        self.ensure_synced()
        if not self.managed:
            return self.committed + 1
        while True:
            if self._failure is not None:
                self._recover()
            elif self._pause_at is not None and self.committed >= self._pause_at:
                self._pause()
            else:
                return self.committed + 1

    def _recover_now(self) -> None:
        while self._failure is not None:
            self._recover()

    def _trigger(self, type_: str, **fields: Any) -> None:
        """Tell the agent this rank reached a fault trigger (a step's start, joining, receiving
        state). While faults are armed, wait for its "go": an injected fault then lands exactly
        here (a SIGKILL at step 17 kills the rank in step 17, not a few steps later when the
        agent's thread got the CPU). Never waits for long: the run matters more than the test."""
        if not self._watched:
            self._channel.send(make(type_, **fields))
            return
        self._wait_seq += 1
        self._go.clear()
        self._channel.send(make(type_, wait=self._wait_seq, **fields))
        if not self._go.wait(GO_TIMEOUT_S):
            print(f"hotspare: rank {self.rank}: no answer from the agent to {type_!r} within "
                  f"{GO_TIMEOUT_S:.0f} s; going on", file=sys.stderr, flush=True)

    def _report_commit(self, msg: dict[str, Any]) -> None:
        """Rank 0 reports every commit at once: the coordinator's count of committed steps, hence
        of steps lost to a total loss, stays exact. So does each rank's first commit of a
        generation (it ends a recovery's downtime). The other ranks' commits go out in batches
        (COMMITS_HELD or COMMITS_HELD_S), or with their next message: they carry per-rank step
        timings for the health service, and are all delivered, in order, unless the rank dies."""
        if self.rank == 0 or self._reported_gen != self.generation:
            self._reported_gen = self.generation
            self._channel.send(msg)
        else:
            self._channel.send_later(msg, COMMITS_HELD, COMMITS_HELD_S)

    def _report_crash(self, step: int, ev: BaseException) -> None:
        tb = "".join(traceback.format_exception(type(ev), ev, ev.__traceback__))
        self._channel.send(make("crash", gen=self.generation, rank=self.rank, step=step,
                                error=f"{type(ev).__name__}: {ev}"[:2000], traceback=tb[-20000:]))

    def _report_checkpoint(self, info) -> None:
        """From the checkpoint writer's thread, the moment the write is durable: the coordinator
        falls back to the newest checkpoint it has heard of, so it should hear at once."""
        if self._channel is None:
            return
        try:
            self._channel.send(make("checkpointed", gen=self.generation, rank=self.rank,
                                    step=info.step, path=info.path))
        except OSError:
            pass            # the link is gone: this worker is being ended, nobody to tell

    def _is_peer_failure(self, ev: BaseException) -> bool:
        if isinstance(ev, (PeerFailure, dist.DistError)) or self._comm_error is not None:
            return True
        if self._group is not None and self._group.aborted:
            return True
        text = str(ev).lower()
        if "internal assert" in text:
            return False
        return isinstance(ev, RuntimeError) and any(m in text for m in _COMM_MARKERS)

    def _entering_reduction(self) -> None:
        """Called by the comm hook on each bucket: note that this rank reached this step's
        gradient exchange. Nothing is sent: when the job stalls, the coordinator probes every
        rank, and the control thread answers with this (the hang detector tells the stuck rank
        from the ones waiting in the exchange)."""
        step = self._current
        if self._exchange_t is None and step is not None:
            if self._slow > 1.0:     # injected `slow`: this worker really computes F times slower
                time.sleep((self._slow - 1.0) * (time.perf_counter() - self._step_t0))
            self._exchange_t = time.perf_counter()
        if step is not None:
            self._reducing_step = step

    # ------------------------------------------------------------------ health vote (runtime/vote.py)
    def _start_vote(self, step: int) -> None:
        """On a vote step, launch the vote as the step begins: the parameters the step will use
        are final by now, and the tiny all-reduce then runs while forward and backward compute;
        the last gradient bucket waits for it, so a verdict still lands before any optimizer
        steps."""
        self._vote = None
        due = step % (self.fingerprint_every or DEFAULT_VOTE_EVERY) == 0 or (
            step == self._verify_at and self.fingerprint_every > 0)
        if not due or self.world_size < 2 or not self._ddps \
                or self._generation_broken():
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        with_fp = self.fingerprint_every > 0
        if self._params is None:     # rebuilt after every join: a sync may have replaced tensors
            self._params = word_views(p for ddp in self._ddps for p in ddp.module.parameters())
        fp = fingerprint(views=self._params) if with_fp else 0
        self._fp_s = time.perf_counter() - t0
        self._voting = (step, with_fp)
        table = row(self.world_size, self.rank, fp, self._pause_gen == self.generation)
        if self._params and self._params[0].device.type != "cpu":
            table = table.to(self._params[0].device)
        try:
            self._vote = dist.all_reduce(table, async_op=True).get_future()
        except Exception as e:       # the generation broke under us: the step fails like any collective
            self._note_comm_error(e)
            self._vote = torch.futures.Future()
            self._vote.set_exception(PeerFailure(f"health vote could not start: {e}"[:300]))
        self._charge_check(t0, c0)

    def _charge_check(self, t0: float, c0: float) -> None:
        """Add a health check's wall time (since perf_counter ``t0``) and CPU time (since
        thread_time ``c0``) to this step's totals."""
        self._check_s += time.perf_counter() - t0
        self._check_cpu += time.thread_time() - c0

    def _take_vote(self) -> torch.futures.Future | None:
        vote, self._vote = self._vote, None
        return vote

    def _settle_vote(self) -> BaseException | None:
        """Judge a vote no gradient bucket consumed; the error that fails the step, if any."""
        vote = self._take_vote()
        try:
            self._judge(vote.wait()[0])
        except Exception as e:
            if not isinstance(e, (HealthFault, StateTrackingError)):
                self._note_comm_error(e)
            return e
        return None

    def _scale_and_inspect(self, buf: torch.Tensor) -> None:
        """Per gradient bucket, before it is reduced: scale it by 1/world and note whether this
        rank's own gradients hold NaN/Inf, in one pass (``vote.scale_and_check``, which also sets
        the bucket's NaN sentinel). The local flag is read only if the reduced sentinels turn
        out non-finite: then it says which rank produced the garbage."""
        t0, c0 = time.perf_counter(), time.thread_time()
        flat = buf.view(-1)
        if self._nan_pending:        # injected `nan`: this rank's gradients of this step break
            self._nan_pending = False
            flat[0] = float("nan")
        if self._nonfinite is None:
            self._nonfinite = torch.zeros(1, dtype=torch.float32, device=flat.device)
        scale_and_check(flat, 1.0 / self.world_size, self._nonfinite)
        self._charge_check(t0, c0)

    def _judge(self, table: torch.Tensor) -> None:
        """The summed vote table (same on every rank) -> this step's verdict; raises HealthFault."""
        step, with_fp = self._voting
        result = tally(table.cpu(), step, with_fp)
        if result.kind == "fingerprint" and self.fingerprint_every > 1:
            result = dataclasses.replace(result, detail=(
                f"{result.detail}; the previous vote was {self.fingerprint_every} steps earlier, so the "
                "corrupt values may have reached the other replicas' updates meanwhile "
                "(--fingerprint-every 1 catches them before)"))
        if result.failed and result.kind == "fingerprint" and step == self._verify_at:
            # One update after state moved to some ranks, and their parameters already differ
            # from their peers': what they received was not everything the step depends on.
            self._tracking = (f"ranks {', '.join(map(str, result.suspects)) or '?'} differ from their peers one "
                              f"step after state was transferred (generation {self.generation}): the script keeps "
                              "state that is not tracked (an LR scheduler, a loss scaler, a counter or a "
                              "generator the update depends on). Pass it to job.track(...); this is a bug in "
                              "the script, not a hardware fault")
            raise StateTrackingError(self._tracking)
        if result.failed:
            self._health = result
            raise HealthFault(result)
        if result.pause:
            self._pause_at = step

    def _before_optimizer_step(self, *_: Any) -> None:
        """NaN/Inf in the reduced gradients (a NaN sentinel, see ``_scale_and_inspect``): every
        rank sees the same reduced bits, so every rank stops here alike, with no exchange on
        healthy steps. Only then do the ranks compare their own gradients, to name the rank
        that produced the garbage."""
        if not self.managed or self._current is None or not self._buckets:
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        buckets, self._buckets = self._buckets, []
        if buckets[0].device.type == "cpu":     # a float per bucket: a few microseconds, no tensors
            finite = all(math.isfinite(float(b[0])) for b in buckets)
        else:                                   # one sync on an accelerator
            finite = bool(torch.isfinite(torch.stack([b[0] for b in buckets])).all())
        self._charge_check(t0, c0)
        if finite:
            return
        mine = self._nonfinite is not None and bool(self._nonfinite.item() > 0)
        flags = torch.zeros(self.world_size, dtype=torch.float32, device=buckets[0].device)
        flags[self.rank] = float(mine)
        try:
            dist.all_reduce(flags)
        except Exception as e:
            self._note_comm_error(e)
            raise
        result = nonfinite_verdict(flags.cpu(), self._current)
        if result.failed:
            self._health = result
            raise HealthFault(result)
        # Every rank's own gradients were non-finite: the script's numerics (e.g. a loss scaler
        # overflowing), deterministic on every replica; not a hardware fault, so let it through.

    def _apply_fault(self, fault: dict[str, Any]) -> None:
        """An injected worker fault (hotspare run --inject), carried out for real."""
        kind = fault["kind"]
        if kind == "slow":
            self._slow = float(fault["params"]["factor"])
        elif kind == "nan":
            self._nan_pending = True
        elif kind == "corrupt":
            # Flip the lowest mantissa bit of one parameter value: silent, tiny, and real.
            params = [p for ddp in self._ddps for p in ddp.module.parameters()] or \
                [t for _, t in self.registry.snapshot().tensors if t.is_floating_point()]
            target = max(params, key=lambda p: p.numel())
            with torch.no_grad():
                target.detach().view(-1).view(torch.int32)[0] ^= 1
        print(f"hotspare: rank {self.rank}: injected {kind} {fault.get('params') or ''}".rstrip(),
              file=sys.stderr, flush=True)

    def _note_comm_error(self, e: BaseException) -> None:
        self._comm_error = f"{type(e).__name__}: {str(e)[:300]}"

    def _generation_broken(self) -> bool:
        return self._group is None or self._group.aborted

    def _check_generation(self) -> None:
        if self._generation_broken():
            raise PeerFailure(f"generation {self.generation} was aborted")

    # ------------------------------------------------------------------ recovery
    def _recover(self) -> None:
        from hotspare.runtime.ddp import reset_after_failure
        reason, self._failure = self._failure, None
        health, self._health, self._pause_at = self._health, None, None
        self._rollback(self._failed_step)
        self._failed_step = None
        self._teardown()
        for ddp in self._ddps:
            reset_after_failure(ddp)
        extra = {}
        if health is not None:
            extra["health"] = {"kind": health.kind, "suspects": list(health.suspects),
                               "step": self.committed + 1, "detail": health.detail}
        self._channel.send(make("failed", gen=self.generation, rank=self.rank,
                                committed=self.committed, error=reason or "", **extra))
        msg = self._await_generation()
        if msg is None:
            raise JobFailed("the coordinator stopped the job during recovery (see the launcher's output)")
        self._join_until_ok(msg)

    def _join_until_ok(self, msg: dict[str, Any]) -> None:
        """Join a generation; if a peer fails meanwhile, report it and join the next one."""
        while True:
            if msg["type"] == "handoff":
                self._handoff(msg)           # never returns: this worker's part is over
            try:
                self._join(msg)
                return
            except Exception as e:
                if not (self._is_peer_failure(e) or isinstance(e, PeerFailure)):
                    raise
                self._teardown()
                self._channel.send(make("failed", gen=self.generation, rank=self.rank,
                                        committed=self.committed, error=f"during join: {e}"[:300]))
                msg = self._await_generation()
                if msg is None:
                    raise JobFailed("the coordinator stopped the job during recovery") from None

    def _join(self, msg: dict[str, Any]) -> None:
        self._teardown()
        t0 = time.perf_counter()
        self.generation, self.rank, self.world_size = msg["gen"], msg["rank"], msg["world"]
        if msg.get("moved"):
            # State moves in this generation: one update later, every rank's parameters must
            # still agree (the same step on every rank: the vote is a collective).
            self._verify_at = msg["target"] + 2
        self._params = None
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size))
        self._trigger("joining", gen=self.generation, rank=self.rank)
        join_timeout = float(msg.get("join_timeout") or os.environ.get(ENV_JOIN_TIMEOUT, 5.0))
        handoff_bytes, handoff_s = (self._receive_handoff(msg, join_timeout) if msg.get("handoff")
                                    else (0, 0.0))
        t0 = time.perf_counter()
        self._group = GenerationGroup(self._store, msg["gen"], msg["rank"], msg["world"], msg["prefix"],
                                      join_timeout_s=join_timeout)
        if self._group.gen <= self._aborted_upto:
            self._group.abort()
        self._group.connect()            # published first, so an abort can interrupt the rendezvous
        rebuild_s = time.perf_counter() - t0
        nbytes, transfer_s = handoff_bytes, handoff_s
        if self.registry:
            nb, ts = self._sync_state(msg)
            nbytes, transfer_s = nbytes + nb, transfer_s + ts
        else:
            self._pending_sync = msg        # initial sync once the script has tracked its state
        self._channel.send(make("joined", gen=self.generation, rank=self.rank, bytes=nbytes,
                                committed=self.committed, pending=self._pending_sync is not None,
                                timings={"rebuild": rebuild_s, "transfer": transfer_s}))

    def _guarded(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:
            if not self._is_peer_failure(e):
                self._report_crash(self.committed + 1, e)
                raise
            self._failure = f"during state sync: {e}"[:300]

    def _sync_state(self, msg: dict[str, Any]) -> tuple[int, float]:
        """Bring every receiver to the source's committed state; returns (bytes, seconds)."""
        self._pending_sync = None
        if msg.get("restore"):
            # No copy survived in memory (or --resume): every rank reads the checkpoint itself.
            self._trigger("transfer", gen=self.generation, rank=self.rank, role="restore")
            t0 = time.perf_counter()
            self.committed = self._applied = self._persist.restore(msg["restore"])
            return self.registry.snapshot().nbytes(), time.perf_counter() - t0
        source, receivers, target = msg["source"], sorted(msg["receivers"]), msg["target"]
        if not receivers:
            return 0, 0.0
        key = f"state/{source}"
        if self.rank == source or self.rank in receivers:
            self._trigger("transfer", gen=self.generation, rank=self.rank,
                          role="source" if self.rank == source else "receiver")
        if self.rank == source:
            if self.committed != target:
                raise StateMismatch(f"rank {self.rank} was chosen as source for step {target} "
                                    f"but holds step {self.committed}")
            manifest, tensors = self._outgoing(self.rows.rows_for(self.committed), self.world_size)
            self._group.store.set(key, json.dumps(manifest))
            stats = broadcast_state(tensors, source, None, is_source=True, receivers=receivers)
        elif self.rank in receivers:
            manifest = _check_manifest(json.loads(self._group.store.get(key)), "the source rank")
            dsts, finish = self._destinations(manifest)
            stats = broadcast_state(dsts, source, None, is_source=False, receivers=receivers)
            finish()
        else:
            return 0, 0.0
        return stats.bytes, stats.seconds

    def _outgoing(self, rows: torch.Tensor | None, count: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """What a source sends: the replicated state, which gradients exist, and ``count`` rows
        of per-rank state (every rank's, or the migrating rank's own)."""
        snap = self.registry.snapshot()
        manifest = snap.manifest(self.committed)
        manifest["grads"] = self.grads.mask()
        manifest["rows"] = None if rows is None else {"count": count, "nbytes": rows.numel() // count}
        return manifest, [t.detach() for _, t in snap.tensors] + ([rows] if rows is not None else [])

    def _destinations(self, manifest: dict[str, Any]):
        """Where received tensors go, and what to do once they are in. A process that has not
        built its objects yet (a spare taking over a migrating rank, in init()) keeps them aside
        until the script has tracked its state."""
        meta = manifest.get("rows")
        rows = None
        if meta is not None:
            count, nbytes = meta.get("count"), meta.get("nbytes")
            if not (isinstance(count, int) and isinstance(nbytes, int) and 0 < count <= 1 << 20
                    and 0 < nbytes and count * nbytes <= 1 << 32):
                raise StateMismatch(f"malformed per-rank state description from the source: {meta!r}")
            rows = torch.empty(count * nbytes, dtype=torch.uint8)
        if not self.registry:
            staged = [torch.empty(shape, dtype=_dtype(dt)) for _, dt, shape in manifest["entries"]]

            def finish() -> None:
                self.committed = self._applied = manifest["step"]
                self._staged = (manifest, staged, rows)
            return staged + ([rows] if rows is not None else []), finish
        dsts, needs_load = self.registry.prepare_receive(manifest)

        def finish() -> None:
            with torch.no_grad():
                self.registry.finish_receive(manifest, dsts, needs_load)
            self._take_rank_state(manifest, rows)
        return dsts + ([rows] if rows is not None else []), finish

    def _apply_staged(self) -> None:
        manifest, staged, rows = self._staged
        self._staged = None
        dsts, needs_load = self.registry.prepare_receive(manifest)
        with torch.no_grad():
            for dst, src in zip(dsts, staged):
                dst.copy_(src)
            self.registry.finish_receive(manifest, dsts, needs_load)
        self._take_rank_state(manifest, rows)

    def _take_rank_state(self, manifest: dict[str, Any], rows: torch.Tensor | None) -> None:
        """After the replicated state is in: this rank's own per-rank state and gradients."""
        self.committed = self._applied = step = manifest["step"]
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
            self.rankstate.restore(table[self.rank if count > 1 else 0])
            if count == self.world_size:
                self.rows.keep(step, rows)
        elif step >= 0:
            print(f"hotspare: rank {self.rank}: the per-rank state of step {step} (random generators, "
                  "buffers, data position) was not replicated before its rank was lost; this rank goes on "
                  "from its own, so the run may differ from one without the failure", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ live migration
    def _pause(self) -> None:
        """Leave the generation after the agreed step; wait to rejoin, or hand our state over."""
        self._pause_at = None
        self._teardown()
        self._channel.send(make("paused", gen=self.generation, rank=self.rank, committed=self.committed))
        msg = self._await_generation()
        if msg is None:
            raise JobFailed("the coordinator stopped the job during a live migration")
        self._join_until_ok(msg)

    def _pair(self, msg: dict[str, Any], rank: int, join_timeout: float) -> GenerationGroup:
        self._teardown()
        self._group = GenerationGroup(self._store, msg["gen"], rank, 2, msg["handoff"],
                                      join_timeout_s=join_timeout)
        if self._group.gen <= self._aborted_upto:
            self._group.abort()
        self._group.connect()
        return self._group

    def _handoff(self, msg: dict[str, Any]) -> None:
        """The migrating rank sends its own state to the spare taking its place, then exits."""
        code = 0
        try:
            group = self._pair(msg, 0, float(msg.get("join_timeout") or 30.0))
            self._trigger("transfer", gen=msg["gen"], rank=self.rank, role="source")
            table = self.rows.rows_for(self.committed)
            own = (table.view(self.world_size, -1)[self.rank].clone() if table is not None
                   else self.rankstate.capture())
            manifest, tensors = self._outgoing(own, 1)
            group.store.set("state/handoff", json.dumps(manifest))
            stats = broadcast_state(tensors, 0, None, is_source=True, receivers=[1])
            self._channel.send(make("handed_off", gen=msg["gen"], rank=self.rank, bytes=stats.bytes,
                                    seconds=stats.seconds))
        except Exception as e:   # the spare died: the new generation recovers from a replica
            print(f"hotspare: rank {self.rank}: handoff failed: {e}", file=sys.stderr, flush=True)
            code = 1
        self._teardown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def _receive_handoff(self, msg: dict[str, Any], join_timeout: float) -> tuple[int, float]:
        """The spare's half of a live migration: receive the old worker's state directly."""
        group = self._pair(msg, 1, join_timeout)
        self._trigger("transfer", gen=msg["gen"], rank=msg["rank"], role="receiver")
        manifest = _check_manifest(json.loads(group.store.get("state/handoff")), "the migrating rank")
        dsts, finish = self._destinations(manifest)
        stats = broadcast_state(dsts, 0, None, is_source=False, receivers=[1])
        finish()
        self._teardown()
        return stats.bytes, stats.seconds

    def _teardown(self) -> None:
        if self._group is not None:
            self._group.destroy()
            self._group = None

    def _finish(self) -> bool:
        """Report completion; True when released, False if a recovery needs us first."""
        self._channel.send(make("done", gen=self.generation, rank=self.rank, step=self.committed,
                                digest=self.digest, rank_digest=self.rank_digest))
        msg = self._await_generation()
        if msg is None:
            return True
        self._join_until_ok(msg)
        return False

    # ------------------------------------------------------------------ control channel
    def _read_control(self) -> None:
        try:
            while True:
                msg = self._channel.recv()
                if msg is None:
                    break
                if msg["type"] == "abort":
                    # Remember it: the abort may overtake the generation's group being built.
                    self._aborted_upto = max(self._aborted_upto, msg["gen"])
                    group = self._group
                    if group is not None and group.gen <= self._aborted_upto:
                        group.abort()
                elif msg["type"] == "exit_now":       # injected fault: an abrupt exit
                    os._exit(msg["code"])
                elif msg["type"] == "fault":          # injected fault the worker does to itself
                    self._faults.put(msg)
                elif msg["type"] == "pause":          # live migration: stop after the next step
                    self._pause_gen = msg["gen"]
                elif msg["type"] == "watch":          # report each step's start (faults armed)
                    self._watched = msg["steps"]
                elif msg["type"] == "go":             # the agent has acted on our trigger
                    if msg["wait"] == self._wait_seq:
                        self._go.set()
                elif msg["type"] == "probe":          # the job stalls: where is this rank?
                    if msg["gen"] == self.generation and self.rank is not None:
                        step = self._reducing_step
                        self._channel.send(make("reducing", gen=self.generation, rank=self.rank,
                                                step=-1 if step is None else step))
                else:
                    self._inbox.put(msg)
        except (OSError, ProtocolError) as e:
            print(f"hotspare: control channel error: {e}", file=sys.stderr, flush=True)
        # The agent is gone: nothing can coordinate this worker any more.
        self._inbox.put({"type": "release", "reason": "control channel closed"})

    def _await_generation(self) -> dict[str, Any] | None:
        """Block for the next ``generation`` message; None means released."""
        while True:
            msg = self._inbox.get()
            if msg["type"] == "release":
                return None
            if msg["type"] == "checkpoint_now":    # the job is stopping: leave a usable checkpoint
                info = self._persist.save_now(self.committed, msg["directory"])
                self._report_checkpoint(info)
                continue
            return msg


def _check_manifest(manifest: Any, sender: str) -> dict[str, Any]:
    if not isinstance(manifest, dict) or not {"step", "entries", "trees"} <= set(manifest) \
            or not isinstance(manifest["step"], int) or not isinstance(manifest["entries"], list):
        raise StateMismatch(f"malformed state manifest from {sender}")
    return manifest


def _dtype(name: Any) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise StateMismatch(f"unknown dtype {name!r} in a state manifest")
    return dt


_job: Job | None = None


def init() -> Job:
    """Start (or return) this process's job. Call once, where ``init_process_group`` would be."""
    global _job
    if _job is None:
        _job = Job()
        _job._init()
    return _job


def _timedelta(seconds: float):
    import datetime
    return datetime.timedelta(seconds=seconds)
