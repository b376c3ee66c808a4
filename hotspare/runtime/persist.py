"""Glue between the state registry and persistent checkpoints (``hotspare.checkpoint``).

A checkpoint holds exactly what a state transfer carries: the registry's tensors plus its
manifest (JSON metadata), so restoring one goes through the same ``prepare_receive`` /
``finish_receive`` path as receiving from a peer. The fingerprint covers the *model* entries
only (names, dtypes, shapes): it identifies the job's model whether or not the optimizer has
created its state yet.

A worker writes and reads checkpoints only inside the directories its launcher named in the
worker contract (``JobEnv.checkpoint_dir``, and ``resume_dir`` for ``--resume``), symbolic
links resolved: an order naming another path is refused. Every checkpoint is signed and
verified with the key in the file ``JobEnv.checkpoint_key`` names (``hotspare.checkpoint.auth``).
"""
from __future__ import annotations

import os
import sys
from typing import Callable

import torch

from hotspare.checkpoint import (AsyncCheckpointer, CheckpointError, CheckpointInfo, fingerprint_of, load,
                                 load_key, save, within)
from hotspare.errors import ConfigError
from hotspare.protocol.workerenv import JobEnv, WorkerEnv
from hotspare.runtime.state import Snapshot, StateRegistry

PROCESS_ENV = object()    # Persister's default: this process's own contract, read from os.environ


def fingerprint(registry: StateRegistry) -> str:
    modules = {n for n, o in registry.objects().items() if isinstance(o, torch.nn.Module)}
    snap = registry.snapshot()
    return fingerprint_of({"/".join(map(str, p)): (str(t.dtype), list(t.shape))
                           for p, t in snap.tensors if p[0] in modules})


def _payload(snap: Snapshot, step: int) -> tuple[dict[str, torch.Tensor], dict]:
    return ({f"t{i:06d}": t.detach() for i, (_, t) in enumerate(snap.tensors)}, snap.manifest(step))


class Persister:
    """Periodic asynchronous checkpoints by the generation's rank 0, as configured by the launcher."""

    def __init__(self, registry: StateRegistry, on_done: Callable[[CheckpointInfo], None] | None = None,
                 env: JobEnv | None = PROCESS_ENV):  # type: ignore[assignment]
        """``on_done`` hears of each finished background write at once, from the writer thread.
        ``env``: the worker contract that names the checkpoint directories, intervals and key
        (a ``WorkerEnv`` or its job-wide ``JobEnv``); None: not managed, so no directory is
        configured and every write or restore is refused. Left out, it is read from this
        process's environment (``WorkerEnv.from_env(os.environ)``)."""
        if env is PROCESS_ENV:
            env = WorkerEnv.from_env(os.environ)
        self.registry = registry
        self._on_done = on_done
        self.directory = env.checkpoint_dir if env else None
        self._resume_dir = env.resume_dir if env else None
        self._key_file = env.checkpoint_key if env else None
        self._async: AsyncCheckpointer | None = None
        self._every = (env.checkpoint_every if env else 0) or None
        self._seconds = (env.checkpoint_seconds if env else 0.0) or None
        self._key: bytes | None = None
        self.sharded = None       # a sharded job's own writer and reader (hotspare/sharded/checkpoints.py)

    def enable_sharded(self, job) -> None:
        """A sharded job (runtime/sharded.py): every rank writes and restores its own shard."""
        if self._seconds:
            raise ConfigError("--checkpoint-seconds does not apply to a sharded job: every rank writes its shard "
                              "at the same steps, so use --checkpoint-every N")
        from hotspare.sharded.checkpoints import ShardedCheckpoints
        self.sharded = ShardedCheckpoints(job, self.directory, self._every, self._signing_key, self._on_done,
                                          lambda: fingerprint(self.registry))

    def _signing_key(self) -> bytes:
        if self._key is None:
            self._key = load_key(self._key_file)    # None: $HOTSPARE_CHECKPOINT_KEY, else the default file
        return self._key

    def _confined(self, path: str, roots: list[str | None], what: str) -> None:
        if not within(path, roots):
            allowed = " or ".join(r for r in roots if r) or "(none configured)"
            raise CheckpointError(f"refused to {what} {path}: it is outside the job's checkpoint "
                                  f"directory {allowed}")

    def _refuse_sharded(self, what: str) -> None:
        # A rank-0 checkpoint of a sharded job (hotspare/sharded) would hold rank 0's shard only,
        # and a restore would load it into every rank: never written, never read (docs/SHARDED.md).
        if self.registry.sharded:
            raise CheckpointError(f"refused to {what}: this job's state is sharded (FSDP2/HSDP): one rank's "
                                  "state is not the job's; its checkpoints are written by every rank, at "
                                  "--checkpoint-every steps (hotspare/sharded/checkpoints.py)")

    def _writer(self) -> AsyncCheckpointer | None:
        if self.registry.sharded:
            return None
        if self.directory and (self._every or self._seconds) and self._async is None:
            self._async = AsyncCheckpointer(self.directory, fingerprint(self.registry),
                                            interval_steps=self._every, interval_seconds=self._seconds,
                                            on_done=self._on_done, key=self._signing_key())
        return self._async

    def after_commit(self, step: int) -> CheckpointInfo | None:
        """Start a background write if one is due; return a write that finished, if any (never
        with ``on_done``: that hears of it first). A failed write is said on stderr and training
        goes on: storage trouble must not take a healthy rank down (the next write is tried at
        its interval; the report counts the checkpoints that were written)."""
        if self.sharded is not None:
            self.sharded.after_commit(step)       # every rank, its own shard
            return None
        writer = self._writer()
        if writer is None:
            return None
        try:
            done = writer.poll()
        except CheckpointError as e:
            print(f"hotspare: rank 0: {e}; training goes on, the next checkpoint is tried at its interval",
                  file=sys.stderr, flush=True)
            done = None
        if writer.due(step):
            writer.submit(step, *_payload(self.registry.snapshot(), step))
        return done

    def flush(self) -> None:
        """Let a background write still in flight finish (the last step is done: a daemon writer
        would die with the process, and the checkpoint with it)."""
        if self.sharded is not None:
            self.sharded.flush()
        if self._async is not None:
            try:
                self._async.wait()
            except CheckpointError as e:
                print(f"hotspare: rank 0: {e}", file=sys.stderr, flush=True)

    def save_now(self, step: int) -> CheckpointInfo:
        """A synchronous checkpoint into the job's checkpoint directory (the job is stopping and
        this is its last copy). The directory is the worker contract's, never a message's."""
        directory = self.directory
        if directory is None:
            raise CheckpointError("no checkpoint directory in this worker's contract (HOTSPARE_CHECKPOINT_DIR)")
        self._refuse_sharded("write a checkpoint")
        if self._async is not None:
            self._async.wait()
        return save(directory, step, *_payload(self.registry.snapshot(), step), fingerprint(self.registry),
                    key=self._signing_key())

    def restore(self, path: str) -> int:
        """Load a verified checkpoint into the tracked objects; returns its step."""
        self._confined(path, [self.directory, self._resume_dir], "restore from")
        if self.sharded is not None:
            return self.sharded.restore(path)
        self._refuse_sharded("restore a checkpoint")
        step, tensors, manifest, _info = load(path, fingerprint(self.registry), key=self._signing_key())
        dsts, needs_load = self.registry.prepare_receive(manifest)
        with torch.no_grad():
            for i, dst in enumerate(dsts):
                dst.copy_(tensors[f"t{i:06d}"])
            self.registry.finish_receive(manifest, dsts, needs_load)
        return step
