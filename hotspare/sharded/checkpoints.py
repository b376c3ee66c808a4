"""A sharded job's checkpoints, in the worker: every rank writes its own shard, and restores it.

``--checkpoint-dir DIR --checkpoint-every N`` on a sharded (FSDP2 / HSDP) job: after step k
commits, where k is a multiple of N (the same steps on every rank), each rank copies its state
(the local tensors of its tracked objects, their manifest, and its per-rank row as the step
committed) and a background thread writes it into the step's shared folder; rank 0's thread
then waits for every rank's shard, signs the index and publishes the checkpoint
(hotspare/checkpoint/sharded.py), and reports it to the coordinator like any checkpoint. A rank
waits for its previous write before it starts the next, so every rank writes the same steps.

``restore`` loads this rank's shard of a checkpoint the coordinator vetted (index MAC, every
file's sha256), checked again here from the bytes it loads: the ``--resume`` of a sharded job,
and the fallback when a lost shard is in no survivor's memory (hotspare/sharded/fallback.py).
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import torch

from hotspare.checkpoint.layout import CheckpointError, CheckpointInfo
from hotspare.checkpoint.sharded import publish, read_shard, tmp_folder, write_shard
from hotspare.errors import StateMismatch

Job = Any      # runtime/job.py ``Job``: typed loosely, the import goes one way
JOIN_S = 600.0


class ShardedCheckpoints:
    def __init__(self, job: Job, directory: str | None, every: int | None,
                 key: Callable[[], bytes], on_done: Callable[[CheckpointInfo], None] | None,
                 fingerprint: Callable[[], str]):
        self.job, self.directory, self.every = job, directory, every
        self._key, self._on_done, self._fingerprint = key, on_done, fingerprint
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ write
    def after_commit(self, step: int) -> None:
        """On every rank, as step ``step`` commits: start its shard's write if the step is due."""
        if not self.directory or not self.every or step % self.every:
            return
        self.flush()      # the previous write first: every rank writes every due step
        job = self.job
        snap = job.registry.snapshot()
        tensors = [(p, t.detach().clone()) for p, t in snap.tensors]    # a consistent copy, now
        manifest = snap.manifest(step)
        row = job.rows.own_at_commit
        row = (row if row is not None else job.rankstate.capture()).clone()
        rank, world, gen = job.rank, job.world_size, job.generation
        args = (step, rank, world, gen, manifest, tensors, row, self._fingerprint(), self._key())
        self._thread = threading.Thread(target=self._write, args=args, daemon=True,
                                        name=f"hotspare-shard-ckpt-{step}")
        self._thread.start()

    def _write(self, step, rank, world, gen, manifest, tensors, row, fingerprint, key) -> None:
        folder = tmp_folder(self.directory, step, gen)
        try:
            write_shard(folder, step, rank, world, fingerprint, manifest, tensors, row)
            if rank == 0:
                info = publish(self.directory, folder, step, world, fingerprint, key=key,
                               cancelled=lambda: self.job.generation != gen)
                if self._on_done is not None:
                    self._on_done(info)
        except (OSError, CheckpointError, ValueError) as e:
            # storage trouble must not take a healthy rank down: said, and the next one is tried
            print(f"hotspare: rank {rank}: sharded checkpoint of step {step} not written: {e}",
                  file=sys.stderr, flush=True)

    def flush(self) -> None:
        """Wait for the write in flight (the job ends: a daemon writer would die with it)."""
        t, self._thread = self._thread, None
        if t is not None:
            t.join(JOIN_S)

    # ------------------------------------------------------------------ restore
    def restore(self, path: str) -> int:
        """Load this rank's shard of the checkpoint folder ``path``; returns its step."""
        job = self.job
        shard = read_shard(path, job.rank, job.world_size, key=self._key(), fingerprint=self._fingerprint())
        reg = job.registry
        dsts, needs_load = reg.prepare_receive(shard.manifest)
        if len(dsts) != len(shard.tensors):
            raise StateMismatch(f"rank {job.rank}'s shard in {path} holds {len(shard.tensors)} tensors, its "
                                f"manifest {len(dsts)}")
        with torch.no_grad():
            for dst, (_, t) in zip(dsts, shard.tensors):
                if dst.shape != t.shape or dst.dtype != t.dtype:
                    raise StateMismatch(f"rank {job.rank}'s shard in {path}: {t.dtype} {list(t.shape)} does not fit "
                                        f"{dst.dtype} {list(dst.shape)}")
                dst.copy_(t)
            reg.finish_receive(shard.manifest, dsts, needs_load)
        if shard.row is not None:
            job.rankstate.restore(shard.row)
            job.rows.own_at_commit = None
        return shard.step


__all__ = ["ShardedCheckpoints"]
