"""Sharded jobs (FSDP2 / HSDP) in the worker: the step's gate, buddy snapshots, and restoring a
rank's shard after a failure. ``job.device_mesh(...)`` creates it.

The script is torch's own FSDP2 code over hotspare's mesh::

    mesh = job.device_mesh((4,), ("fsdp",))          # or (2, 2), ("replicate", "shard"): HSDP
    for block in model.blocks: fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), ...)
    job.track(model=model, optimizer=opt, scheduler=sched)

Every step (``with step:``), on every rank:

1. As the step's first forward through a tracked FSDP root begins, this rank's shards (the
   local tensors of the model and the optimizer state: the state after the last update, which
   does not change before this step's ``optimizer.step()``) are packed and sent to its buddy
   in a thread, overlapped with forward and backward; the rank receives its predecessor's.
2. The gate, just before ``optimizer.step()`` (the gradients are reduced and clipped): wait for
   both transfers; send the buddy the step's final gradient shards and the optimizer's
   hyperparameters (the *log*); receive the predecessor's; then gather every rank's per-rank
   row (runtime/rankstate.py), as DDP's exchange does. A rank steps only once that gather is
   complete, hence only once every rank's buddy holds its state of step k-1 and its log of
   step k: whatever a failure leaves behind, every rank's shard at the survivors' step is in
   memory. This is the commit rule of runtime/steps.py, unchanged: a collective that fails
   fails the step, on every rank, before any optimizer steps.
3. After a failure, the new generation's state sync (runtime/statesync.py) brings the
   replicated parts (scheduler, optimizer hyperparameters, step counters, per-rank rows) to the
   survivors' step T; then ``after_sync`` gathers every rank's status and carries out
   ``sharded.plan.plan_restore``: a rank whose shard is not at T receives its buddy's copy and
   loads it, replaying step T's optimizer update from the log when the copy is of T-1. Nothing
   rolls back; no step is repeated.
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hotspare.errors import ConfigError, PeerFailure, StateMismatch
from hotspare.sharded import fallback, memory
from hotspare.sharded.mesh import ShardedMesh
from hotspare.sharded.plan import NONE, BuddyStatus, buddy_of, default_stride
from hotspare.transfer import buddy as wire
from hotspare.transfer.buddy import BuddyStore, Packet

# The job (runtime/job.py ``Job``) that creates this runtime: typed loosely so the import goes
# one way (job.py imports this module).
Job = Any

THREAD_JOIN_S = 30.0
ENV_STRIDE = "HOTSPARE_BUDDY_STRIDE"


class _Transfer(threading.Thread):
    """One packet to or from the buddy group, off the training thread."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True, name="hotspare-buddy")
        self._fn, self._args = fn, args
        self.result: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self._fn(*self._args)
        except BaseException as e:      # noqa: BLE001 - reported by the training thread
            self.error = e

    def outcome(self, timeout: float | None = THREAD_JOIN_S) -> Any:
        self.join(timeout)
        if self.is_alive():
            raise PeerFailure("a buddy snapshot transfer did not finish")
        if self.error is not None:
            raise self.error
        return self.result


class ShardedRuntime:
    def __init__(self, job: Job, shape: tuple[int, ...], names: tuple[str, ...]):
        self.job = job
        self.store = BuddyStore()
        self._replaying = False
        self._prepared = False
        self._optimizer: torch.optim.Optimizer | None = None
        self._sending: tuple[int, _Transfer, _Transfer] | None = None   # (step, send, recv)
        self._digest: tuple[int, str] | None = None
        self.restores: list[dict[str, Any]] = []     # what each restore of this rank did (the report's)
        # This rank's shard is its own (an original rank, a survivor) or not (a spare, until restored).
        self._own_valid = not job.managed or job.role == "active"
        self._stash: tuple[int, list[tuple[tuple, torch.Tensor]]] | None = None
        self._said_memory = False
        if job.managed:
            m = job.members
            self.mesh = ShardedMesh(shape, names, m.rank, lambda: job.members.group,
                                    on_error=job.collectives.note)
            self.device_mesh = self.mesh.device_mesh
            local = int(os.environ.get("LOCAL_WORLD_SIZE", m.world_size))
            self.stride = int(os.environ.get(ENV_STRIDE, 0)) or default_stride(m.world_size, local)
            if m.world_size > 1:
                self.buddy = buddy_of(m.rank, m.world_size, self.stride)
                self.pred = buddy_of(m.rank, m.world_size, m.world_size - self.stride)
            m.before_sync.append(self.before_sync)
            m.after_sync.append(self.after_sync)
            register_optimizer_step_pre_hook(self._gate)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            self.mesh = None
            self.device_mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)

    @classmethod
    def create(cls, job: Job, existing: "ShardedRuntime | None", shape, names) -> "ShardedRuntime":
        """``job.device_mesh(shape, mesh_dim_names)``, checked."""
        if existing is not None:
            raise ConfigError("job.device_mesh() is called once per job")
        shape, names = tuple(int(x) for x in shape), tuple(names)
        n = 1
        for x in shape:
            n *= x
        if n != job.world_size:
            raise ConfigError(f"job.device_mesh({shape}) spans {n} ranks; the job has {job.world_size}")
        if len(shape) not in (1, 2):
            raise ConfigError("hotspare's sharded jobs take a 1-D mesh (FSDP) or a 2-D (replicate, shard) "
                              f"mesh (HSDP); got {len(shape)} dimensions")
        if job.managed:
            job._persist.enable_sharded(job)     # every rank writes and restores its own shard (sharded/checkpoints.py)
        return cls(job, shape, names)

    # ------------------------------------------------------------------ what is sharded
    def _prepare(self) -> None:
        if self._prepared:
            return
        self._prepared = True
        reg = self.job.registry
        objs = reg.objects()
        opts = [objs[n] for n in reg.sharded if isinstance(objs[n], torch.optim.Optimizer)]
        if len(opts) > 1:
            raise ConfigError("a sharded job under hotspare tracks one optimizer over its DTensor parameters; "
                              f"found {len(opts)}")
        self._optimizer = opts[0] if opts else None
        for name in reg.sharded:
            obj = objs[name]
            if isinstance(obj, torch.nn.Module):
                # before FSDP's own pre-forward, while the parameters are still sharded
                obj.register_forward_pre_hook(self._forward_begins, prepend=True)

    def _shards(self) -> list[tuple[tuple, torch.Tensor]]:
        """(path, live local tensor) of every tracked sharded object, in the registry's order."""
        reg = self.job.registry
        names = reg.sharded
        return [(p, t) for p, t in reg.snapshot().tensors if p[0] in names]

    # ------------------------------------------------------------------ 1. the snapshot, overlapped
    def _forward_begins(self, module, args) -> None:
        step = self.job.protocol.current
        if self.mesh is None or step is None or self._replaying or self.job.members.world_size < 2:
            return
        if self._sending is None or self._sending[0] != step:
            self._start_snapshot(step)

    def _start_snapshot(self, step: int) -> None:
        shards = self._shards()             # references, taken on the training thread
        applied = self.job.progress.applied
        try:
            group = self.mesh.buddy_group()
        except Exception as e:
            self.job.collectives.note(e)
            raise
        send = _Transfer(lambda: wire.send(wire.pack("state", applied, shards), self.buddy, group))
        recv = _Transfer(wire.recv, self.pred, group)
        self._sending = (step, send, recv)

    # ------------------------------------------------------------------ 2. the gate
    def _gate(self, opt, args, kwargs) -> None:
        p = self.job.protocol
        step = p.current
        if self._replaying or step is None or opt is not self._optimizer or self.mesh is None:
            return
        m = self.job.members
        try:
            m.check()
            if m.world_size > 1:
                if self._sending is None or self._sending[0] != step:
                    self._start_snapshot(step)
                _, send, recv = self._sending
                self._sending = None
                send.outcome()
                state: Packet = recv.outcome()
                log = wire.pack("log", step, self._grads(opt), {"groups": _hyper(opt), "none": self._none(opt)})
                group = self.mesh.buddy_group()
                out = _Transfer(wire.send, log, self.buddy, group)
                pred_log = wire.recv(self.pred, group)
                out.outcome()
                self.store.confirm(self.pred, state, pred_log)
            p.rows.begin(m.group, m.world_size, step)
            p.rows.finish()
        except Exception as e:
            p.collectives.note(e)
            raise PeerFailure(f"sharded step gate: {type(e).__name__}: {e}"[:300]) from e

    @staticmethod
    def _grads(opt) -> list[tuple[tuple, torch.Tensor]]:
        out = []
        for i, prm in enumerate(q for g in opt.param_groups for q in g["params"]):
            if prm.grad is not None:
                g = prm.grad
                out.append((("grad", i), g.to_local() if isinstance(g, DTensor) else g))
        return out

    @staticmethod
    def _none(opt) -> list[int]:
        return [i for i, prm in enumerate(q for g in opt.param_groups for q in g["params"]) if prm.grad is None]

    # ------------------------------------------------------------------ 3. after a failure
    def after_failure(self) -> None:
        """The generation is torn down: finish the buddy transfers in flight (a snapshot that
        arrived whole is kept as ``fresh``), and put FSDP's per-iteration state back."""
        sending, self._sending = self._sending, None
        if sending is not None:
            _, send, recv = sending
            for t in (send, recv):
                t.join(THREAD_JOIN_S)
            if recv.error is None and not recv.is_alive() and recv.result is not None:
                try:
                    self.store.offer_fresh(self.pred, recv.result)
                except StateMismatch as e:
                    print(f"hotspare: rank {self.job.rank}: {e}", file=sys.stderr, flush=True)
        if self.mesh is not None:
            self.mesh.forget()
        self.reset_modules()

    def reset_modules(self) -> None:
        """A step failed: FSDP's per-iteration state back to idle, every parameter sharded."""
        for name in self.job.registry.sharded:
            obj = self.job.registry.objects()[name]
            if isinstance(obj, FSDPModule) and obj._get_fsdp_state()._is_root is not None:  # never run: nothing to reset
                _reset_fsdp(obj)

    def before_sync(self, msg: dict[str, Any]) -> None:
        """The replicated sync writes the source's tensors into a receiver's, shards included (it
        also builds a spare's optimizer state): a receiver whose shard is its own keeps a copy."""
        self._prepare()
        self._stash = None
        m = self.job.members
        if self.job.registry.sharded and self._own_valid and m.rank in set(msg.get("receivers") or []):
            self._stash = (self.job.progress.applied, [(p, t.clone()) for p, t in self._shards()])

    def _unstash(self) -> int:
        """Put back the shard kept by ``before_sync``; the step it is at, or NONE."""
        stash, self._stash = self._stash, None
        if stash is None:
            return NONE
        step, saved = stash
        live = dict(self._shards())
        if {p for p, _ in saved} != set(live):
            opt = self._optimizer
            if opt is not None and not any(p[1:2] == ("state",) for p, _ in saved):
                opt.state.clear()      # kept before this rank's first update: no optimizer state
                live = dict(self._shards())
            if {p for p, _ in saved} != set(live):
                return NONE
        with torch.no_grad():
            for p, t in saved:
                live[p].copy_(t)
        return step

    def after_sync(self, msg: dict[str, Any]) -> None:
        """On every rank of a new generation, after the replicated state sync (Membership's
        ``after_sync`` hook): bring every rank's shard to the synced step."""
        self._prepare()
        m, job = self.job.members, self.job
        if not job.registry.sharded:
            return
        if msg.get("restore"):         # every rank loaded its own shard of the checkpoint (sharded/fallback.py)
            m.restored = [fallback.from_checkpoint(self, msg["restore"])]
            self._own_valid, self._stash = True, None
            if m.world_size > 1:
                self._exchange_snapshots(job.progress.committed)
            return
        if m.world_size < 2:
            return
        target = job.progress.committed
        receivers = set(msg.get("receivers") or [])
        if m.rank in receivers:
            own = self._unstash()
        else:
            own = target if self._own_valid else NONE
        owner = self.store.owner if self.store.owner is not None else NONE
        st, lg, fr = self.store.steps()
        mine = torch.tensor(BuddyStatus(own, owner, st, lg, fr).row(), dtype=torch.int64)
        rows = torch.empty(m.world_size * mine.numel(), dtype=torch.int64)
        m.group.all_gather(rows, mine).wait()
        status = [BuddyStatus(*r) for r in rows.view(m.world_size, -1).tolist()]
        replicas = self.mesh.groups[0] if len(self.mesh.shape) == 2 else None   # HSDP: (replicate, shard)
        plan, reason = fallback.checked_plan(self, status, target, replicas)   # every copy verified first
        if reason is not None:
            fallback.unrecoverable(self, target, reason)     # the job goes back to its newest checkpoint
        group = self.mesh.buddy_group() if plan else None
        for src in plan:
            if m.rank == src.holder:
                state = (wire.pack("state", target, self._shards()) if src.kind == "replica"
                         else self.store.fresh if src.kind == "fresh" else self.store.state)
                wire.send(state, src.rank, group)
                if src.replay:
                    wire.send(self.store.log, src.rank, group)
            elif m.rank == src.rank:
                state = wire.recv(src.holder, group)
                log = wire.recv(src.holder, group) if src.replay else None
                self._load(state, log, target)
                self._own_valid = True
                nbytes = state.nbytes + (log.nbytes if log else 0)
                self.restores.append({"step": target, "source": src.kind, "from_rank": src.holder,
                                      "snapshot_step": state.step, "bytes": nbytes})
                what = ("its live replica" if src.kind == "replica" else
                        f"the snapshot of step {state.step}" + (f" + the log of step {log.step}, replayed" if log else ""))
                print(f"hotspare: rank {m.rank}: shard of step {target} restored from rank {src.holder}: {what} "
                      f"({nbytes} bytes, sha256 checked)", file=sys.stderr, flush=True)
        m.restored = fallback.sources(self, target)    # the report's words
        self._exchange_snapshots(target)

    def _exchange_snapshots(self, step: int) -> None:
        """Every rank's shard of ``step`` to its buddy, now (a generation begins: the buddies of
        the first generation and of restored ranks hold nothing or an older copy)."""
        group = self.mesh.buddy_group()
        mine = wire.pack("state", step, self._shards())
        out = _Transfer(wire.send, mine, self.buddy, group)
        got = wire.recv(self.pred, group)
        out.outcome()
        self.store.confirm(self.pred, got, None)
        reg = self.job.registry        # the host RAM the snapshots take: said, and refused before step 0
        self._said_memory |= memory.check(self.job.members.group, self.job.rank, self.job.world_size, mine.nbytes,
                                          memory.log_bytes(o for n, o in reg.objects().items() if n in reg.sharded
                                                           and isinstance(o, torch.nn.Module)),
                                          self.stride, say=not self._said_memory,
                                          before_first_step=step < 0 or self.job.generation == 1)

    def _load(self, state: Packet, log: Packet | None, target: int) -> None:
        state.verify()
        if log is not None:
            log.verify()
        live = dict(self._shards())
        got = state.tensors()
        opt = self._optimizer
        if opt is not None and not any(p[1:2] == ("state",) and p[0] in self.job.registry.sharded
                                       and isinstance(self.job.registry.objects()[p[0]], torch.optim.Optimizer)
                                       for p, _ in got):
            opt.state.clear()        # a snapshot from before the first update: no optimizer state yet
            live = dict(self._shards())
        if set(live) != {p for p, _ in got}:
            raise StateMismatch(f"buddy snapshot entries differ from this rank's shards: "
                                f"{sorted(map(str, set(live) ^ {p for p, _ in got}))[:4]}")
        with torch.no_grad():
            for path, t in got:
                dst = live[path]
                if dst.shape != t.shape or dst.dtype != t.dtype:
                    raise StateMismatch(f"buddy snapshot {'/'.join(map(str, path))}: {t.dtype} {list(t.shape)} "
                                        f"does not fit {dst.dtype} {list(dst.shape)}")
                dst.copy_(t)
        if log is not None:
            self._replay(log)

    def _replay(self, log: Packet) -> None:
        """Step ``log.step``'s optimizer update, again, from its final gradients and hyperparameters:
        the same optimizer on the same shard with the same inputs gives the same bits."""
        opt = self._optimizer
        params = [q for g in opt.param_groups for q in g["params"]]
        grads = {path[1]: t for path, t in log.tensors()}
        before = [q.grad for q in params]
        saved = _hyper(opt)
        try:
            _set_hyper(opt, log.extra["groups"])
            for i, q in enumerate(params):
                if i in grads:
                    g = torch.zeros_like(q)
                    (g.to_local() if isinstance(g, DTensor) else g).copy_(grads[i])
                    q.grad = g
                else:
                    q.grad = None
            self._replaying = True
            opt.step()
        finally:
            self._replaying = False
            _set_hyper(opt, saved)
            for q, g in zip(params, before):
                q.grad = g

    # ------------------------------------------------------------------ the job's digest
    def compute_digest(self) -> str:
        """sha256 over every rank's digest of its shards (and replicated state), in rank order: the
        same on every rank, and the same under torchrun. A collective: every rank calls it, at
        the end of the job."""
        local = bytes.fromhex(self.job.registry.digest(per_rank=self.job.rankstate.buffer_names()))
        mine = torch.frombuffer(bytearray(local), dtype=torch.uint8)
        world = self.job.world_size
        out = torch.empty(world * mine.numel(), dtype=torch.uint8)
        if self.job.managed:
            self.job.members.group.all_gather(out, mine).wait()
        else:
            dist.all_gather_into_tensor(out, mine)
        self._digest = (self.job.committed, hashlib.sha256(out.numpy().data).hexdigest())
        return self._digest[1]

    def digest(self) -> str:
        if self._digest is None or self._digest[0] != self.job.committed:
            raise ConfigError("job.digest of a sharded job is known once its last step is done "
                              "(it combines every rank's shards); read it after the loop")
        return self._digest[1]

    def snapshot_bytes(self) -> int:
        return self.store.nbytes()


def _jsonable(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str)) or (
        isinstance(v, (list, tuple)) and all(_jsonable(x) for x in v))


def _hyper(opt) -> list[dict[str, Any]]:
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params" and _jsonable(v)}
            for g in opt.param_groups]


def _set_hyper(opt, groups: list[dict[str, Any]]) -> None:
    if len(groups) != len(opt.param_groups):
        raise StateMismatch("a gradient log's parameter groups differ from the optimizer's")
    for g, vals in zip(opt.param_groups, groups):
        for k, v in vals.items():
            g[k] = tuple(v) if isinstance(g.get(k), tuple) else v


def _reset_fsdp(module) -> None:
    """FSDP2's own recovery after a failed forward/backward (torch 2.13 ``reset_iter_state``).
    It waits for the all-gather in flight, whose group is aborted by now: its error is
    expected; the wait is then dropped and the reset run again."""
    for _ in range(8):
        try:
            module.reset_iter_state()
            break
        except Exception:       # noqa: BLE001 - the aborted generation's collective
            state = module._get_fsdp_state()
            ctx = state._comm_ctx
            ctx.all_gather_state = None
            for s in state._state_ctx.all_states:
                for pg in s._fsdp_param_groups:
                    pg._all_gather_result = None
    else:
        module.reset_iter_state()
    # reset_iter_state leaves the gradients autograd wrote into unsharded parameters before the
    # backward failed (a param group whose post-backward never ran): the re-run's backward would
    # add to them. Found by HSDP's failover test (a survivor's backward stopped in the
    # replicate all-reduce): drop them.
    for s in module._get_fsdp_state()._state_ctx.all_states:
        for pg in s._fsdp_param_groups:
            for fp in pg.fsdp_params:
                if hasattr(fp, "_unsharded_param"):
                    fp._unsharded_param.grad = None
                fp.unsharded_accumulated_grad = None


__all__ = ["ShardedRuntime"]
