"""Sharded jobs (FSDP2 / HSDP) in the worker: the step's gate, buddy snapshots, and restoring a
rank's shard after a failure. ``job.device_mesh(...)`` creates it.

The script is torch's own FSDP2 code over hotspare's mesh::

    mesh = job.device_mesh((4,), ("fsdp",))          # or (2, 2), ("replicate", "shard"): HSDP
    for block in model.blocks: fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), ...)
    job.track(model=model, optimizer=opt, scheduler=sched)

Every step (``with step:``), on every rank (docs/SHARDED.md):

1. As the step's first forward through a tracked FSDP root begins, when a snapshot is due
   (every ``HOTSPARE_SNAPSHOT_EVERY`` steps, default 8): this rank's shards (the local tensors
   of the model and the optimizer state: the state after the last update, unchanged until this
   step's ``optimizer.step()``) are checksummed and sent from their own memory to its buddy,
   over the generation's buddy link (transfer/links.py), in a thread overlapped with forward
   and backward; the rank receives its predecessor's.
2. The gate, just before ``optimizer.step()`` (the gradients are reduced and clipped): wait for
   a snapshot in flight; send the buddy the step's final gradient shards and the optimizer's
   hyperparameters (the *log*); receive the predecessor's; then gather every rank's per-rank
   row (runtime/rankstate.py), as DDP's exchange does, with each rank's byte of the pause vote
   of a live migration (sharded/pause.py). A rank steps only
   once that gather is complete, hence only once every rank's buddy holds a snapshot of some
   step s and the logs of s+1 .. k: whatever a failure leaves behind, every rank's shard at
   the survivors' step is in memory. This is the commit rule of runtime/steps.py, unchanged.
3. After a failure, the new generation's state sync (runtime/statesync.py) brings the
   replicated parts to the survivors' step T; then ``after_sync`` gathers every rank's status
   and carries out ``sharded.plan.plan_restore``: a rank whose shard is not at T receives its
   buddy's copy and loads it, replaying the logged optimizer updates from the snapshot's step
   to T (sharded/replay.py). Nothing rolls back; no step is repeated.
"""
from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.distributed.fsdp import FSDPModule

from hotspare.errors import ConfigError, PeerFailure, StateMismatch
from hotspare.protocol import auth
from hotspare.runtime.phase import PauseAgreed
from hotspare.sharded import fallback, memory
from hotspare.sharded import replay as rp
from hotspare.sharded.fsdpreset import reset_fsdp
from hotspare.sharded.mesh import ShardedMesh
from hotspare.sharded.pause import PauseVote
from hotspare.sharded.plan import NONE, BuddyStatus, buddy_of, default_stride
from hotspare.transfer import buddy as wire
from hotspare.transfer import links
from hotspare.transfer.buddy import BuddyStore, Packet, Transfer

# The job (runtime/job.py ``Job``) that creates this runtime: typed loosely so the import goes
# one way (job.py imports this module).
Job = Any

THREAD_JOIN_S = wire.JOIN_S
ENV_STRIDE = "HOTSPARE_BUDDY_STRIDE"
ENV_EVERY = "HOTSPARE_SNAPSHOT_EVERY"
DEFAULT_EVERY = 8     # steps between buddy snapshots (the logs of every step fill the gaps)


def snapshot_every(env=os.environ) -> int:
    """``HOTSPARE_SNAPSHOT_EVERY``: a buddy snapshot every this many steps (default 8); 0: none
    at all, no logs either (a lost shard then comes only from an HSDP replica; for measuring
    what the snapshots cost)."""
    raw = env.get(ENV_EVERY, "").strip()
    try:
        every = int(raw) if raw else DEFAULT_EVERY
    except ValueError:
        every = -1
    if every < 0:
        raise ConfigError(f"{ENV_EVERY}={raw!r}: a number of steps (0: no buddy snapshots)")
    return every


class ShardedRuntime:
    def __init__(self, job: Job, shape: tuple[int, ...], names: tuple[str, ...]):
        self.job = job
        self.every = snapshot_every() if job.managed else 0
        self.store = BuddyStore(keep=self.every + 2)     # a snapshot, its logs, one in flight
        self._sent = NONE                                # the step of the last snapshot every rank sent
        self._replaying = False
        self._prepared = False
        self._optimizer: torch.optim.Optimizer | None = None
        self._sending: tuple[int, Transfer] | None = None   # (step, the snapshot's exchange)
        self._listener: links.Listener | None = None       # this worker's buddy-link listener
        self._links: tuple[Any, links.Links] | None = None  # (generation, its links)
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
                if self.every:
                    self._key = auth.peer_key_from_env()
                    self._listener = links.Listener(links.bind_host())
            self.pause = PauseVote(lambda: job.driver.state.pause_gen == job.members.generation,
                                   lambda step: job.driver.handle(PauseAgreed(step)))
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
        return reg.snapshot(names=set(reg.sharded)).tensors

    # ------------------------------------------------------------------ 1. the snapshot, overlapped
    def _forward_begins(self, module, args) -> None:
        step = self.job.protocol.current
        if self.mesh is None or step is None or self._replaying or self.job.members.world_size < 2:
            return
        if self._snapshot_due(step):
            try:
                self.job.members.check()
            except Exception as e:
                self.job.collectives.note(e)
                raise
            self._start_snapshot(step)

    def _snapshot_due(self, step: int) -> bool:
        """A snapshot of step - 1 goes out at ``step``, the same decision on every rank: once
        ``every`` steps have committed since the last one (the generation's first exchange is one)."""
        return (bool(self.every) and step - 1 - self._sent >= self.every
                and (self._sending is None or self._sending[0] != step))

    def _start_snapshot(self, step: int) -> None:
        shards = self._shards()             # references, taken on the training thread
        applied = self.job.progress.applied
        try:
            link = self._buddy_links()
        except Exception as e:
            self.job.collectives.note(e)
            raise
        self._sending = (step, Transfer(self._swap_snapshots, applied, shards, link))

    def _buddy_links(self) -> links.Links:
        """This generation's links to the buddy and from the predecessor (transfer/links.py),
        made at the generation's first exchange, by every rank at once."""
        gen = self.job.members.group
        if self._links is not None and self._links[0] is gen:
            return self._links[1]
        self._close_links()
        m = self.job.members
        made = links.link_up(self._listener, gen.store, self._key, m.generation, m.rank, self.buddy, self.pred,
                             THREAD_JOIN_S, lambda: gen.aborted, gen.adopt)
        self._links = (gen, made)
        return made

    def _close_links(self) -> None:
        if self._links is not None:
            self._links[1].close()
            self._links = None

    def _swap_snapshots(self, step: int, shards, link: links.Links) -> Packet:
        """In a thread, overlapped with forward and backward: this rank's snapshot out, its
        predecessor's in (verified here, off the training thread)."""
        got = link.exchange(wire.view("state", step, shards), self.store.buffers)
        got.verify()
        return got

    # ------------------------------------------------------------------ 2. the gate
    def _gate(self, opt, args, kwargs) -> None:
        p = self.job.protocol
        step = p.current
        if self._replaying or step is None or opt is not self._optimizer or self.mesh is None:
            return
        m = self.job.members
        try:
            m.check()
            if m.world_size > 1 and self.every:
                self._buddy_gate(step, opt)
            # every rank's row, and its byte of the pause vote (sharded/pause.py)
            p.rows.begin(m.group, m.world_size, step, flag=self.pause.flag() if m.world_size > 1 else None)
            self.pause.judge(step, p.rows.finish())   # a live migration leaves once this step is committed
        except Exception as e:
            p.collectives.note(e)
            raise PeerFailure(f"sharded step gate: {type(e).__name__}: {e}"[:300]) from e

    def _buddy_gate(self, step: int, opt) -> None:
        """The snapshot started this step (if one is due) is waited for and kept; this step's log
        goes to the buddy and the predecessor's is kept on top of its snapshot."""
        if self._snapshot_due(step):
            self._start_snapshot(step)
        sending = self._sending
        if sending is not None and sending[0] == step:
            self._sending = None
            self.store.keep_state(self.pred, sending[1].outcome())
            self._sent = step - 1
        grads, none = rp.grads(opt)
        log = wire.view("log", step, grads, {"groups": rp.hyper(opt), "none": none})
        self.store.add_log(self.pred, self._buddy_links().exchange(log, self.store.buffers))
        if not self._said_memory and self.job.rank == 0 and opt.state:     # the optimizer's state exists
            self._said_memory = True
            self._say_memory(sum(t.numel() * t.element_size() for _, t in self._shards()))

    # ------------------------------------------------------------------ 3. after a failure
    def after_failure(self) -> None:
        """The generation is torn down: finish the buddy transfers in flight (a snapshot that
        arrived whole is kept as ``fresh``), and put FSDP's per-iteration state back."""
        sending, self._sending = self._sending, None
        if sending is not None:
            t = sending[1]
            t.join(THREAD_JOIN_S)
            if t.error is None and not t.is_alive() and t.result is not None:
                try:
                    self.store.offer_fresh(self.pred, t.result)
                except StateMismatch as e:
                    print(f"hotspare: rank {self.job.rank}: {e}", file=sys.stderr, flush=True)
        if self.mesh is not None:
            self.mesh.forget()
        self._close_links()
        self.reset_modules()

    def reset_modules(self) -> None:
        """A step failed: FSDP's per-iteration state back to idle, every parameter sharded."""
        for name in self.job.registry.sharded:
            obj = self.job.registry.objects()[name]
            if isinstance(obj, FSDPModule) and obj._get_fsdp_state()._is_root is not None:  # never run: nothing to reset
                reset_fsdp(obj)

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
        elif msg.get("handoff") and not self._own_valid:
            own = self._handed_over(target)
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
                for log in self.store.logs_to(target) if src.replay else ():
                    wire.send(log, src.rank, group)
            elif m.rank == src.rank:
                state = wire.recv(src.holder, group)
                logs = [wire.recv(src.holder, group) for _ in range(target - src.snap_step)] if src.replay else []
                self._load(state, logs, target)
                self._own_valid = True
                nbytes = state.nbytes + sum(g.nbytes for g in logs)
                self.restores.append({"step": target, "source": src.kind, "from_rank": src.holder,
                                      "snapshot_step": state.step, "logs": len(logs), "bytes": nbytes})
                print(f"hotspare: rank {m.rank}: shard of step {target} restored from rank {src.holder}: "
                      f"{_what(src.kind, state, logs)} ({nbytes} bytes, checksum checked)", file=sys.stderr, flush=True)
        m.restored = fallback.sources(self, target)    # the report's words
        self._exchange_snapshots(target)

    def _handed_over(self, target: int) -> int:
        """This worker took its rank in a live migration: the migrating rank sent it its own
        state of ``target`` directly (runtime/membership.py ``handoff``), shards included."""
        self._own_valid = True
        nbytes = sum(t.numel() * t.element_size() for _, t in self._shards())
        self.restores.append({"step": target, "source": "own memory", "from_rank": self.job.members.rank,
                              "snapshot_step": target, "bytes": nbytes})
        print(f"hotspare: rank {self.job.members.rank}: shard of step {target} handed over from the migrating "
              f"rank's own memory ({nbytes} bytes of shards, live migration)", file=sys.stderr, flush=True)
        return target

    def _exchange_snapshots(self, step: int) -> None:
        """Every rank's shard of ``step`` to its buddy, now (a generation begins: the buddies of
        the first generation and of restored ranks hold nothing or an older copy)."""
        if not self.every:
            return
        self._sent = step
        mine = wire.view("state", step, self._shards())
        got = self._buddy_links().exchange(mine, self.store.buffers)
        nbytes = mine.nbytes
        self.store.keep_state(self.pred, got)
        reg = self.job.registry        # the host RAM the snapshots take: refused before step 0 if it cannot fit
        nbytes += memory.unmade_state_bytes(self._optimizer)    # before step 0: AdamW's moments, estimated
        memory.check(self.job.members.group, self.job.rank, self.job.world_size, nbytes,
                     memory.log_bytes(o for n, o in reg.objects().items() if n in reg.sharded
                                      and isinstance(o, torch.nn.Module)),
                     self.stride, self.every, say=self.job.generation == 1 and step < 0,
                     before_first_step=step < 0 or self.job.generation == 1)

    def _say_memory(self, shard: int) -> None:
        opt = self._optimizer
        grads = sum(q.to_local().numel() * q.element_size() if hasattr(q, "to_local") else q.numel() * q.element_size()
                    for q in rp.params_of(opt)) if opt is not None else 0
        # kept for the predecessor: its snapshot, one arriving, `every` logs and one arriving
        # (this rank's own go from its tensors' memory: sharded/memory.py)
        total = 2 * shard + (self.every + 1) * grads
        print(f"hotspare: sharded job: rank 0's shard (parameters and optimizer state) is {shard / 2**20:.2f} MB, "
              f"its gradient log {grads / 2**20:.2f} MB; a buddy snapshot every {self.every} steps "
              f"({ENV_EVERY}), a log every step: about {total / 2**20:.2f} MB of host RAM per rank",
              file=sys.stderr, flush=True)

    def _load(self, state: Packet, logs: list[Packet], target: int) -> None:
        state.verify()
        for log in logs:
            log.verify()
        if [g.step for g in logs] != list(range(state.step + 1, target + 1)) or (not logs and state.step != target):
            raise StateMismatch(f"buddy snapshot of step {state.step} with logs {[g.step for g in logs]}: "
                                f"not a run to step {target}")
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
        if logs:
            rp.replay(self._optimizer, logs, self._set_replaying)   # steps state.step + 1 .. target, again

    def _set_replaying(self, on: bool) -> None:
        self._replaying = on

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


def _what(kind: str, state: Packet, logs: list[Packet]) -> str:
    if kind == "replica":
        return "its live replica"
    if not logs:
        return f"the snapshot of step {state.step}"
    steps = f"the log of step {logs[0].step}" if len(logs) == 1 else f"the logs of steps {logs[0].step}-{logs[-1].step}"
    return f"the snapshot of step {state.step} + {steps}, replayed"


__all__ = ["ShardedRuntime", "snapshot_every"]
