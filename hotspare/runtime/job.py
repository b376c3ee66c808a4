"""The in-process runtime: one ``Job`` per training process, the facade a script talks to.

The step protocol, from the training script's point of view::

    job = hotspare.init()                   # a spare waits here until it takes a rank
    model = job.ddp(model)
    job.track(model=model, optimizer=opt, scheduler=sched)
    for step in job.steps(total):           # or: for epoch in job.epochs(n): for b in loader:
        with step:                          #                                   with job.step():
            ...                             # a failure inside is recovered, at the committed step

A failure anywhere in a step leaves each survivor at step k or k-1; it puts back what the failed
attempt touched (generators, buffers, data position, gradients: docs/CONTRACT.md), tears its
generation down (which frees the peers still blocked in a collective), reports its committed
step and waits. The coordinator forms the next generation with a spare in the dead rank's place;
the most advanced survivor sends the replicated state and every rank's per-rank row; everyone
resumes at the step after it. Nothing is reloaded from disk. An exception that is not a peer's
failure (runtime/failures.py) is the script's own: it is reported with its traceback and the
process dies, like any crash.

The parts, each with one job: ``RankContext`` (runtime/context.py: what the rank keeps, built
once and passed whole), ``AgentLink`` (runtime/link.py: the control channel), the phase machine
(runtime/phase.py: when to recover, pause, join, hand off; pure) and its ``WorkerDriver``
(runtime/driver.py: does what it decides), ``Membership`` (runtime/membership.py: the
generation's group, joining, state sync through runtime/statesync.py), ``StepProtocol``
(runtime/steps.py: a step's life and the gradient-exchange seam ``GradientExchange`` that
runtime/ddp.py and runtime/sharded.py call), ``HealthVote`` (runtime/healthvote.py).

Outside ``hotspare run`` (plain ``torchrun`` or ``python``) the same calls fall back to plain
torch.distributed and DDP, so scripts can adopt hotspare gradually.
"""
from __future__ import annotations

import atexit
import datetime
import faulthandler
import os
import signal
import sys
from typing import Any, Iterator

import torch
import torch.distributed as dist

from hotspare.errors import ConfigError
from hotspare.protocol.workerenv import BACKENDS, WorkerEnv
from hotspare.runtime.context import RankContext
from hotspare.runtime.contract import LoaderGuard, UntrackedWatch, untracked_kinds
from hotspare.runtime.driver import WorkerDriver
from hotspare.runtime.healthvote import HealthVote
from hotspare.runtime.iteration import IterationTop, NextStep, Step, finish_early_stop
from hotspare.runtime.link import AgentLink
from hotspare.runtime.loader import ResumableLoader
from hotspare.runtime.membership import Membership
from hotspare.runtime.objdigest import write_verify_digests
from hotspare.runtime.persist import Persister
from hotspare.runtime.phase import Finished, PauseAgreed, ResumePoint, StepFailed, WorkerPhase
from hotspare.runtime.statesync import StateSync
from hotspare.runtime.steps import Outcome, StepProtocol
from hotspare.runtime.virtual import require_virtual

# Outside hotspare run, rank 0's job.log prints at most every PLAIN_LOG_EVERY_S seconds (and at
# the last step); HOTSPARE_LOG_EVERY_S overrides it (0: every step, as bench/overhead.py needs).
ENV_LOG_EVERY_S = "HOTSPARE_LOG_EVERY_S"
STORE_TIMEOUT_S = 300


class Job:
    """Rank, world size, tracked state and the step loop of one training process. ``env`` is
    the worker environment contract (None: not managed, plain torch.distributed)."""

    def __init__(self, env: WorkerEnv | None = None, *, backend: str | None = None,
                 log_every_s: float | None = None) -> None:
        if backend is not None and backend not in BACKENDS:
            raise ConfigError(f"hotspare.init(backend=...) must be one of {BACKENDS}, got {backend!r}")
        if env is not None and backend is not None and backend != env.backend:
            raise ConfigError(f"hotspare run runs this job on {env.backend}; to use {backend}, pass "
                              f"--backend {backend} to hotspare run")
        self.env = env
        self.managed = env is not None
        self.backend = env.backend if env is not None else backend
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.ctx = ctx = RankContext.new()
        self.registry, self.rankstate, self.grads = ctx.registry, ctx.rankstate, ctx.grads
        self.rows, self.loaders, self.progress, self.collectives = ctx.rows, ctx.loaders, ctx.progress, ctx.collectives
        self.epoch: int | None = None         # the epoch under job.epochs()
        self.link: AgentLink | None = None
        self.members: Membership | None = None
        self.vote: HealthVote | None = None
        self.driver: WorkerDriver | None = None   # the phase machine (managed only)
        self._ddps: list[torch.nn.Module] = []
        self._sharded = None                  # runtime/sharded.py, once job.device_mesh() is called
        self._plain = (0, 1)                  # (rank, world size) outside hotspare run
        self._owns_group = False              # outside hotspare run: init() created the process group
        self._checked_tracking = False
        self._left_early = False              # the script left job.steps/job.epochs before the end
        self._finished = False
        self._crashed = False
        self._persist = Persister(self.registry, on_done=self._report_checkpoint, env=env)
        self.protocol = StepProtocol(ctx)
        self.top = IterationTop(self)          # the top of each loop iteration: undo, recover, note
        if log_every_s is None:
            log_every_s = float(os.environ.get(ENV_LOG_EVERY_S, self.protocol.print_every))
        self.protocol.print_every = log_every_s

    # ------------------------------------------------------------------ where this rank stands
    @property
    def rank(self) -> int | None:
        return self.members.rank if self.managed else self._plain[0]

    @property
    def world_size(self) -> int:
        return self.members.world_size if self.managed else self._plain[1]

    @property
    def generation(self) -> int:
        return self.members.generation if self.managed else 0

    @property
    def committed(self) -> int:
        """The last step committed on this rank."""
        return self.progress.committed

    @property
    def first_step(self) -> int:
        """The first step this process runs: 0, or on a replacement the step after the one its
        predecessor committed (takes the state it was given first). For a progress bar that
        goes on where the lost rank's stopped: ``tqdm(job.steps(n), total=n, initial=job.first_step)``."""
        self._require_tracked("job.first_step")
        self.ensure_synced()
        return self.committed + 1

    @property
    def step_times(self) -> list[float]:
        """Seconds per committed step on this rank."""
        return self.protocol.step_times

    @property
    def digest(self) -> str:
        """sha256 of the replicated state (every tracked tensor but the modules' buffers, and
        the JSON metadata) in a canonical order: the same on every healthy replica."""
        if self._sharded is not None: return self._sharded.digest()   # noqa: E701 - all ranks' shards (runtime/sharded.py)
        return self.registry.digest(per_rank=self.rankstate.buffer_names())

    @property
    def rank_digest(self) -> str:
        """sha256 of this rank's per-rank state (generators, buffers, data position)."""
        return self.rankstate.digest(self.rankstate.capture())

    # ------------------------------------------------------------------ set-up
    def _start(self) -> None:
        if not self.managed:
            self._start_plain()
            return
        env = self.env
        self.worker, self.role = env.worker, env.role
        # Before the coordinator fences this worker it sends SIGUSR1: every thread's stack goes
        # to stderr, so a fence says where the worker was.
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
        self.link = AgentLink(env.agent, env.worker, env.role, where=self._where)
        if env.faults:        # the testing plug-in; registered before the agent's first message
            from hotspare.testing.faults.worker import FaultHooks
            self.ctx.hooks = FaultHooks(self.link, self._fault_targets, lambda: self.rank)
        self.link.connect()   # says hello
        atexit.register(self._at_exit)
        LoaderGuard(lambda: self.protocol.current if self.protocol.current is not None else self.committed + 1,
                    self._contract_failed).install()
        self._previous_hook, sys.excepthook = sys.excepthook, self._excepthook
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)
        sync = StateSync(self.registry, self.rankstate, self.grads, self.rows)
        self.members = Membership(self.ctx, self.link, store, sync, backend=env.backend,
                                  join_timeout_s=env.join_timeout_s, restore=self._persist.restore)
        self.driver = driver = WorkerDriver(self.link, self.members, role=self.role, rollback=self._rollback,
                                            checkpoint=self._checkpoint_now)
        self.link.on_note(driver.notify)
        self.vote = HealthVote(self.members, self.collectives, pause_gen=lambda: driver.state.pause_gen,
                               on_pause=lambda step: driver.handle(PauseAgreed(step)),
                               params=self._ddp_params, every=env.fingerprint_every)
        self.protocol.attach(self.members, self.link, self.vote)
        if self.role == "active":
            self.members.rank = int(os.environ["RANK"])
            self.members.world_size = int(os.environ["WORLD_SIZE"])
        if self.role == "spare" and env.backend == "nccl":
            # Pay CUDA's start-up (context, cuBLAS) while waiting, not in the take-over.
            from hotspare.runtime.cudawarm import warm_cuda
            warm_cuda(f"cuda:{self.local_rank}" if self.local_rank >= 0 else None)
        # A spare waits here until it takes a rank: the script's code after init() runs only
        # with the rank, world size and process group it trains with, as under torchrun.
        self.link.send("ready", worker=self.worker, committed=self.committed)
        # joins its generation, or (a spare released unused) exits, or raises JobFailed
        driver.await_order()

    def _start_plain(self) -> None:
        initialized = dist.is_initialized()
        if not initialized:
            if "WORLD_SIZE" in os.environ:
                dist.init_process_group(self.backend or ("nccl" if torch.cuda.is_available() else "gloo"))
            else:  # plain `python script.py`: a world of one
                dist.init_process_group(self.backend or "gloo", store=dist.HashStore(), rank=0, world_size=1)
        self._plain, self._owns_group = (dist.get_rank(), dist.get_world_size()), not initialized
        atexit.register(self._at_exit)
        self._previous_hook, sys.excepthook = sys.excepthook, self._excepthook
        self.protocol.plain_rank = self._plain[0]

    def _where(self) -> tuple[int, int, int] | None:
        m = self.members
        if m is None or m.rank is None:
            return None
        step = self.protocol.reducing_step
        return m.generation, m.rank, -1 if step is None else step

    def _ddp_params(self) -> list[torch.Tensor]:
        return [p for ddp in self._ddps for p in ddp.module.parameters()]

    def _fault_targets(self) -> list[torch.Tensor]:
        return self._ddp_params() or [t for _, t in self.registry.snapshot().tensors if t.is_floating_point()]

    # ------------------------------------------------------------------ user API
    def ddp(self, module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        """Wrap ``module`` in DistributedDataParallel whose reduction survives failovers."""
        from hotspare.runtime.ddp import wrap_ddp
        ddp = wrap_ddp(module, self.protocol if self.managed else None, **kwargs)
        self._ddps.append(ddp)
        return ddp

    def virtual_ranks(self, module: torch.nn.Module, make_loader, *, seed: int = 0, **ddp_kwargs: Any):
        """An elastic job's DDP over virtual ranks (runtime/virtual.py, docs/CONTRACT.md)."""
        from hotspare.runtime.virtual import virtual_ranks
        return virtual_ranks(self, module, make_loader, seed, ddp_kwargs)

    def device_mesh(self, shape: tuple[int, ...], mesh_dim_names: tuple[str, ...]):
        """A ``DeviceMesh`` for torch's ``fully_shard`` that survives failovers (docs/SHARDED.md)."""
        from hotspare.runtime.sharded import ShardedRuntime
        self._sharded = ShardedRuntime.create(self, self._sharded, shape, mesh_dim_names)
        return self._sharded.device_mesh

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
                obj.register_step_pre_hook(lambda *_: self.protocol.before_optimizer_step())
                obj.register_step_post_hook(lambda *_: self.protocol.after_optimizer_step())

    def loader(self, loader: Any, name: str | None = None) -> ResumableLoader:
        """Wrap a ``DataLoader`` (with a ``DistributedSampler``, workers, collate, transforms) so
        that a failover resumes it exactly: a re-run step gets its batches again, a replacement
        continues its predecessor's stream. See runtime/loader.py."""
        wrapped = ResumableLoader(loader, name or f"loader{len(self.loaders)}", synced=self.ensure_synced,
                                  epoch=lambda: self.epoch, resume_point=self._resume_point)
        self.loaders.append(wrapped)
        self.rankstate.add_part(wrapped)
        return wrapped

    def log(self, **metrics: float) -> None:
        """Attach metrics (e.g. ``loss=loss.item()``) to this step's progress report."""
        self.protocol.log(metrics)

    def epochs(self, total: int) -> Iterator[int]:
        """``for epoch in job.epochs(n)``: the epochs still to run. A replacement starts at its
        predecessor's epoch (from its ``job.loader`` positions), so code between epochs (an
        evaluation, a per-epoch scheduler step) runs once per epoch on every rank, failover or not."""
        if not isinstance(total, int) or total < 0:
            raise ConfigError(f"job.epochs(total) needs a non-negative int, got {total!r}")
        self._require_tracked("job.epochs()")
        self.ensure_synced()
        start = max((l.next_epoch() for l in self.loaders), default=0)
        try:
            for epoch in range(start, total):
                self._resume_point()
                self.epoch = epoch
                yield epoch
        except GeneratorExit:       # `break`: an early stop (finished when the script ends)
            self._left_early = True
            raise
        self._resume_point()
        self.epoch = None
        self._finish_all()

    def step(self) -> NextStep:
        """``with job.step():`` guards the next step of a loop the script drives itself, e.g.
        ``for x, y in loader: with job.step(): ...``; the block's value is the step number."""
        self._require_tracked("job.step()")
        if self.managed and self.epoch is None:
            raise ConfigError("with job.step(): drive the loop around it with `for epoch in job.epochs(n)` "
                              "(a replacement resumes its epoch there, and the job ends when it ends), "
                              "or use `for step in job.steps(total): with step:`")
        return NextStep(self)

    def steps(self, total: int) -> Iterator[Step]:
        """Yield the steps still to run, ``committed + 1 .. total - 1``, recovering as needed.
        Every rank must pass the same ``total``."""
        if not isinstance(total, int) or total < 0:
            raise ConfigError(f"job.steps(total) needs a non-negative int, got {total!r}")
        self._require_tracked("job.steps()")
        self.protocol.total = total
        if not self.managed:
            yield from self._plain_steps(total)
            return
        self.ensure_synced()
        while True:
            self._resume_point()
            step = self._next_step(total)
            if step >= total:
                write_verify_digests(self)     # only under `hotspare verify` (HOTSPARE_VERIFY_OUT)
                if self._finish():
                    self._finished = True
                    return
                continue
            try:
                yield Step(self, step)
            except GeneratorExit:   # `break`: an early stop (finished when the script ends)
                self._left_early = True
                raise

    def ensure_synced(self) -> None:
        """Before the first step: take the state this rank was given when it joined (deferred
        until the script has built and tracked its objects), and check what is tracked."""
        if not self.managed:
            return
        if not self._checked_tracking:
            self._checked_tracking = True
            if self.role == "active":    # the job's first ranks check; a replacement runs the
                self._check_tracking()   # same script and must not spend its take-over on it
        try:
            self.members.apply_pending()
        except Exception as e:
            if not self.collectives.is_peer_failure(e, self.members.broken):
                self.protocol.report_crash(self.committed + 1, e)
                raise
            self.driver.handle(StepFailed(self.committed + 1, f"during state sync: {e}"[:300]))
        self._recover_all()

    # ------------------------------------------------------------------ checks
    def _require_tracked(self, what: str) -> None:
        if not self.registry:
            raise ConfigError(f"call job.track(model=..., optimizer=...) before {what}: "
                              "hotspare must know which state a spare receives")

    def _check_tracking(self) -> None:
        """State hotspare must know about but was not told of: a clear error now (or within a
        few steps, runtime/contract.py), instead of a replacement that silently differs."""
        untracked_kinds(self.registry.objects())
        try:
            require_virtual(self.members.placement, self.rankstate.parts)   # --elastic: runtime/virtual.py
        except ConfigError as e:
            self._contract_failed(e)
        self.top.watch = UntrackedWatch(self.registry.objects(), self.committed + 1)

    def _contract_failed(self, err: ConfigError) -> None:
        """A check of runtime/contract.py failed: the script's error, reported and raised."""
        if self.protocol.current is None:       # inside a step, leaving it reports the crash
            self.protocol.report_crash(self.committed + 1, err)
        raise err

    # ------------------------------------------------------------------ the loop
    def _plain_steps(self, total: int) -> Iterator[Step]:
        if self.world_size > 1:     # every rank must run the same steps (a mismatch hangs DDP)
            totals = torch.tensor([total, -total], dtype=torch.int64)
            dist.all_reduce(totals, op=dist.ReduceOp.MAX)
            if int(totals[0]) != -int(totals[1]):
                raise ConfigError(f"ranks disagree on job.steps(total): this rank has {total}, "
                                  f"others between {-int(totals[1])} and {int(totals[0])}")
        for step in range(self.committed + 1, total):
            try:
                yield Step(self, step)
            except GeneratorExit:   # `break`: an early stop
                self._left_early = True
                raise
        self._finish_all()

    def _next_step(self, total: int | None = None) -> int:
        """The step to run next (or ``total``: the job is done), once any recovery or
        live-migration pause is over (the phase machine's ``ResumePoint``)."""
        while True:
            step = self.committed + 1
            generation = self.driver.state.taken_gen
            self.driver.handle(ResumePoint(self.committed, may_pause=total is None or step < total))
            if self.driver.state.taken_gen == generation:   # nothing to recover, no pause
                return step

    def _begin_context_step(self) -> int:
        self.ensure_synced()
        self._resume_point(capture=False)
        return self._next_step() if self.managed else self.committed + 1

    def _resume_point(self, capture: bool = True) -> None:
        """The top of a loop iteration, between steps (runtime/iteration.py ``IterationTop``)."""
        if self.managed and self.protocol.current is None:
            self.top.arrive(capture)

    def _enter_step(self, step: int) -> None:
        self.protocol.enter(step)

    def _exit_step(self, step: int, ev: BaseException | None) -> bool:
        """True when the failure is swallowed: recovered at the next step."""
        outcome, failure = self.protocol.exit(step, ev)
        if outcome is Outcome.COMMITTED and self.managed and (self.rank == 0 or self._sharded is not None):
            self._persist.after_commit(step)      # a finished write reports itself
        if outcome is Outcome.RECOVER:
            self.driver.handle(failure)           # recovered at the next resume point
            if self._sharded is not None:
                self._sharded.reset_modules()     # FSDP's per-iteration state back to idle
            if self.progress.applied < step:
                self.top.failed(self.registry.objects())   # the rest of the loop body still runs
        return outcome is Outcome.RECOVER

    def _finish_all(self) -> None:
        """The last step is done: report it (managed), or wait for every rank (plain)."""
        self._finished = True
        write_verify_digests(self)         # only under `hotspare verify` (HOTSPARE_VERIFY_OUT)
        if self._sharded is not None and not self.managed: self._sharded.compute_digest()  # noqa: E701
        if self.managed:
            if self.rank == 0 or self._sharded is not None:   # a sharded job: every rank writes its shard
                self._persist.flush()      # a checkpoint in flight reports itself when durable
            while not self._finish():
                pass
        elif self.world_size > 1:
            dist.barrier()

    def _finish(self) -> bool:
        """Report completion; True when released, False if a recovery needs us first."""
        if self._sharded is not None:
            self._sharded.compute_digest()        # a collective: every rank, at the end
        self.driver.handle(Finished({"step": self.committed, "digest": self.digest, "rank_digest": self.rank_digest}))
        return self.driver.phase is WorkerPhase.RELEASED

    def _at_exit(self) -> None:
        """The script ends: finish an early stop (runtime/iteration.py ``finish_early_stop``); under
        torchrun, destroy the group init() made (gloo's threads left to the interpreter's teardown
        have aborted finished workers: "terminate called without an active exception")."""
        finish_early_stop(self)
        if not self.managed and self._owns_group and not self._crashed and dist.is_initialized():
            dist.destroy_process_group()

    def _excepthook(self, et, ev, tb) -> None:
        self._crashed = True
        self._previous_hook(et, ev, tb)

    # ------------------------------------------------------------------ recovery
    def _recover_all(self) -> None:
        """Recover a failed step now (the phase machine's ``ResumePoint``, no pause here)."""
        while self.driver is not None and self.driver.recovering:
            self.driver.handle(ResumePoint(self.committed, may_pause=False))

    def _rollback(self, step: int) -> None:
        """The phase machine's ``Rollback``: what failed ``step`` touched is put back."""
        from hotspare.runtime.ddp import reset_after_failure
        self.protocol.rollback(step)
        self.rows.own_at_commit = None    # no baseline for "changed after the exchange" until the next commit
        for ddp in self._ddps:
            reset_after_failure(ddp)
        if self._sharded is not None:
            self._sharded.after_failure()         # the group is torn down: finish buddy transfers

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_now(self) -> None:
        """The job is stopping: leave a usable checkpoint of the committed state."""
        self._report_checkpoint(self._persist.save_now(self.committed))

    def _report_checkpoint(self, info) -> None:
        """From the checkpoint writer's thread, the moment the write is durable: the coordinator
        falls back to the newest checkpoint it has heard of, so it should hear at once."""
        if self.link is not None:
            self.link.try_send("checkpointed", gen=self.generation, rank=self.rank, step=info.step, path=info.path)


_job: Job | None = None


def init(*, backend: str | None = None, log_every_s: float | None = None) -> Job:
    """Start (or return) this process's job. Call once, where ``init_process_group`` would be.

    ``backend`` ("gloo" or "nccl"): outside ``hotspare run``, the process group's backend (by
    default nccl when CUDA is available, else gloo); under ``hotspare run`` the launcher's
    ``--backend`` decides, and a different choice here is an error. ``log_every_s``: outside
    ``hotspare run``, how often rank 0 prints ``job.log`` metrics (default 10 s)."""
    global _job
    if _job is None:
        job = Job(WorkerEnv.from_env(os.environ), backend=backend, log_every_s=log_every_s)
        job._start()
        _job = job
    return _job
