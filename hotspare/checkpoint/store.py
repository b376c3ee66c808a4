"""Persistent checkpoints: the last resort when no in-memory copy of the state survives.

hotspare recovers from a failure by copying the state from a surviving replica to a warm
spare; a checkpoint on storage is read only when every copy is gone (e.g. a bug or power
event that kills all ranks at once). It is therefore optional, written asynchronously, and
its one job is to be *valid* whenever it is needed.

Layout of a checkpoint ``directory``::

    LATEST                     the name of the newest complete checkpoint ("step-000001200")
    step-000001200/            one complete checkpoint
        .metadata, __0_0.distcp    the tensors, written by torch.distributed.checkpoint (DCP)
        hotspare.json              sidecar: version, step, fingerprint, digest, dtypes/shapes, meta,
                                   the sha256 of every other file, and an HMAC over all of it
    .tmp-step-1300-4711/       a write in progress (or the remains of a crashed one); ignored

Atomicity protocol (a crash at any point leaves the previous checkpoint valid):

1. Write everything into a private ``.tmp-step-<N>-<pid>/``: the DCP payload (DCP fsyncs its
   files), then ``hotspare.json`` (fsynced), then fsync the folder itself.
2. ``os.rename`` it to ``step-<N:09d>/`` -- atomic on POSIX file systems -- and fsync the
   parent. A ``step-*`` folder therefore only ever exists complete; ``.tmp-*`` ones never count.
3. Point ``LATEST`` at it: write a temporary file, fsync, ``os.replace`` (atomic), fsync the
   parent. A crash between 2 and 3 leaves ``LATEST`` at the previous, still complete,
   checkpoint.
4. Prune: keep the newest ``keep`` complete checkpoints, never the one ``LATEST`` names.

Why one writer: the ranks of a data-parallel job hold identical state, so the lowest live
rank writes alone with ``no_dist=True``. No process group is involved, so a checkpoint can
be written (and read) while the group is broken -- exactly when it is needed -- and there is
no collective that a dead peer could hang.

Verification on load (``verify``), before any byte is deserialised: ``hotspare.json`` is plain
JSON; its HMAC-SHA256 under the checkpoint key (``auth``: a file outside the checkpoint
directory) must match, the folder must hold exactly the files it lists (no symbolic links),
and each file's sha256 must be the one listed. Only then is DCP's ``.metadata`` parsed, by a
restricted unpickler that admits DCP's own metadata classes only (``metadata``), from the very
bytes that were hashed; the tensor files are read by DCP with ``torch.load(weights_only=True)``
and their sha256 digest (over sorted keys, dtypes, shapes and bytes) must equal the recorded
one. A corrupt, forged or foreign checkpoint is refused with a ``CheckpointError`` saying what
to do; ``newest_valid`` walks back to the newest checkpoint that passes and says which it
refused and why.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
import warnings
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException as _DCPError  # a BaseException

from hotspare.checkpoint import auth
from hotspare.checkpoint.layout import (FORMAT_VERSION, METADATA, METADATA_MAX, SIDECAR, SIDECAR_MAX,
                                        CheckpointError, CheckpointInfo, fingerprint_of, fsync_dir, meta_digest,
                                        prune, publish_step, step_name, within, write_file_durably)
from hotspare.checkpoint.metadata import UnsafeMetadata, VerifiedReader, parse
from hotspare.checkpoint.sidecar import encode, info_of, latest, newest_valid, verified, verify

__all__ = ["AsyncCheckpointer", "CheckpointError", "CheckpointInfo", "FORMAT_VERSION", "fingerprint_of", "latest",
           "load", "newest_valid", "save", "tensor_digest", "verify", "within"]

# dcp.save/load(no_dist=True) warn on every call that they assume a single process; that is
# exactly our intent (one writer, see the module docstring). A process-wide filter, because
# warnings.catch_warnings() is not thread-safe and the writes run in a background thread.
warnings.filterwarnings(
    "ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")



# --------------------------------------------------------------------------------------------
# tensors


def _byte_view(t: torch.Tensor):
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy()   # zero-copy; works for bf16/bool/any dtype


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors in sorted-key order, including each one's dtype and shape."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key]
        head = json.dumps([key, str(t.dtype), list(t.shape)], separators=(",", ":")).encode()
        h.update(len(head).to_bytes(8, "little"))
        h.update(head)
        h.update(_byte_view(t.cpu()))
    return h.hexdigest()


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def _why(e: BaseException) -> str:
    """A short reason; DCP wraps the real error per rank in a CheckpointException."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            inner = inner[0]    # DCP's (exception, traceback) pair
        if isinstance(inner, BaseException):
            e = inner
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text[:300]}"


# --------------------------------------------------------------------------------------------
# save


def save(directory: str, step: int, tensors: dict[str, torch.Tensor], meta: dict,
         fingerprint: str, *, keep: int = 2, key: bytes | None = None) -> CheckpointInfo:
    """Write a checkpoint synchronously and atomically; see the module docstring.

    ``tensors`` are flat ``{key: Tensor}`` (any dtype, any device; 0-dim allowed), ``meta`` is
    JSON-serialisable (tuples come back as lists). Keeps the newest ``keep`` checkpoints.
    ``key`` signs it (default: the configured checkpoint key file, see ``auth``).
    """
    key = key or auth.load_key()
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be an int >= 0, got {step!r}")
    if keep < 1:
        raise CheckpointError(f"keep must be >= 1, got {keep}")
    for k, v in tensors.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise CheckpointError(f"tensors must map str keys to torch.Tensor; {k!r} maps to "
                                  f"{type(v).__name__}: put non-tensor state into meta")
    try:
        meta_json = json.dumps(meta, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"meta must be JSON-serialisable ({e}); put tensors into "
                              f"`tensors` and convert other objects to str/int/float/list/dict")

    cpu = {k: (v.detach() if v.device.type == "cpu" else v.detach().cpu()).contiguous()
           for k, v in tensors.items()}
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the checkpoint directory {directory}: {e}") from e
    tmp = os.path.join(directory, f".tmp-step-{step}-{os.getpid()}")
    final = os.path.join(directory, step_name(step))
    try:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
        # 1. payload; FileSystemWriter(sync_files=True) fsyncs the data and metadata files.
        dcp.save(cpu, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=True)
        side = {
            "version": FORMAT_VERSION, "step": step, "fingerprint": fingerprint,
            "digest": tensor_digest(cpu), "nbytes": sum(t.nbytes for t in cpu.values()),
            "saved_at": time.time(),
            "tensors": {k: [str(t.dtype), list(t.shape)] for k, t in sorted(cpu.items())},
            "meta_digest": meta_digest(meta_json), "meta": json.loads(meta_json),
            "files": {name: auth.file_sha256(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))},
        }
        data = encode(side, key)          # the signed bytes and their MAC: checked before parsing
        _readable_back(len(data), os.path.getsize(os.path.join(tmp, METADATA)), len(cpu))
        write_file_durably(os.path.join(tmp, SIDECAR), data.decode("ascii"))
        fsync_dir(tmp)
        # 2. publish the folder atomically and point LATEST at it.
        publish_step(directory, tmp, step)
    except _TooBig as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"refused to write the checkpoint for step {step} to {directory}: {e}") from None
    except (Exception, _DCPError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"writing the checkpoint for step {step} to {directory} failed: "
                              f"{_why(e)} (check free space and permissions)") from e
    prune(directory, keep, step)
    return info_of(final, side)


def _readable_back(sidecar_bytes: int, metadata_bytes: int, tensors: int) -> None:
    """Refuse to write a checkpoint that ``verify`` would refuse to read: the caps that keep a
    planted file from costing memory before it is authenticated (``layout.SIDECAR_MAX``)."""
    if sidecar_bytes > SIDECAR_MAX:
        raise _TooBig(f"its {SIDECAR} would be {sidecar_bytes / 2**20:.1f} MiB, more than the "
                      f"{SIDECAR_MAX >> 20} MiB a checkpoint may hold: `meta` and the non-tensor state of "
                      f"the tracked objects ({tensors} tensors) go there; keep large state in tensors")
    if metadata_bytes > METADATA_MAX:
        raise _TooBig(f"its {METADATA} is {metadata_bytes / 2**20:.1f} MiB, more than the "
                      f"{METADATA_MAX >> 20} MiB a checkpoint may hold ({tensors} tensors): track fewer, larger tensors")


class _TooBig(ValueError):
    pass


def load(path_or_directory: str, fingerprint: str | None = None, *, key: bytes | None = None
         ) -> tuple[int, dict[str, torch.Tensor], dict, CheckpointInfo]:
    """Read and verify a checkpoint: ``(step, tensors on CPU, meta, info)``.

    ``path_or_directory`` is a ``step-<N>`` folder or a checkpoint directory (its newest valid
    checkpoint). With ``fingerprint`` set, a checkpoint of another model is refused. ``key``
    defaults to the configured checkpoint key file (``auth``).
    """
    key = key or auth.load_key()
    p = path_or_directory
    if not os.path.isdir(p):
        raise CheckpointError(f"no checkpoint at {p}: the path does not exist; pass the "
                              f"directory the job wrote checkpoints to")
    if os.path.lexists(os.path.join(p, SIDECAR)):
        ckpt = p
    else:
        info, refused = newest_valid(p, key)
        if info is None:
            if not refused:
                raise CheckpointError(
                    f"no complete checkpoint in {p}: it holds no step-<N> folder with a valid "
                    f"{SIDECAR}; check the path, or start the job from scratch")
            raise CheckpointError(f"no valid checkpoint in {p}: " + "; ".join(r for _, r in refused))
        ckpt = info.path

    # Authenticated first: nothing but JSON is read unless the MAC and every file digest fit.
    side, metadata = verified(ckpt, key)
    if fingerprint is not None and side["fingerprint"] != fingerprint:
        raise CheckpointError(
            f"foreign checkpoint: saved by a job with a different model (fingerprint "
            f"{side['fingerprint'][:16]}, this job {fingerprint[:16]}) at {ckpt}; point the "
            f"job at its own checkpoint directory, or restore the model definition it was "
            f"saved with")
    meta = side.get("meta")
    if meta_digest(json.dumps(meta, sort_keys=True)) != side["meta_digest"]:
        raise CheckpointError(f"corrupt checkpoint {ckpt}: {SIDECAR} meta digest mismatch; "
                              f"load an older checkpoint by passing its step-<N> folder")
    try:
        tensors = {k: torch.empty([int(s) for s in shape], dtype=_dtype(dt))
                   for k, (dt, shape) in side["tensors"].items()}
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"corrupt checkpoint {ckpt}: bad tensor list in {SIDECAR} "
                              f"({e})") from None
    try:
        # DCP's .metadata is a pickle: parsed by the restricted unpickler, from the bytes
        # verified above; the tensor files are read with torch.load(weights_only=True).
        md = parse(metadata, set(side["files"]))
        if tensors:
            dcp.load(tensors, storage_reader=VerifiedReader(ckpt, md), no_dist=True)
    except UnsafeMetadata as e:
        raise CheckpointError(f"refused checkpoint {ckpt}: its {METADATA} is not plain DCP metadata "
                              f"({e}); nothing in it was run") from None
    except (Exception, _DCPError) as e:
        raise CheckpointError(
            f"corrupt checkpoint {ckpt}: its tensors cannot be read ({_why(e)}); load an "
            f"older checkpoint by passing its step-<N> folder") from e
    digest = tensor_digest(tensors)
    if digest != side["digest"]:
        raise CheckpointError(
            f"corrupt checkpoint {ckpt}: digest mismatch (recorded {side['digest'][:16]}, "
            f"read {digest[:16]}); the files were damaged after writing -- load an older "
            f"checkpoint by passing its step-<N> folder")
    return side["step"], tensors, meta, info_of(ckpt, side)


# --------------------------------------------------------------------------------------------
# asynchronous writer


class AsyncCheckpointer:
    """Writes checkpoints in one background thread so that training never waits on storage.

    ``submit`` snapshots the tensors (a CPU copy) and returns; if the previous write is still
    running it returns False and skips this step (no queue can grow). ``poll`` reports
    finished writes and re-raises their errors; with ``on_done`` a finished write is handed to
    that callable at once, from the writer thread, instead (errors still surface in ``poll``),
    so whoever tracks the newest durable checkpoint learns of it without waiting for the
    caller's next poll. Optional ``interval_steps`` /
    ``interval_seconds`` drive ``due(step)``, which the caller checks before building a
    snapshot.
    """

    def __init__(self, directory: str, fingerprint: str, keep: int = 2, *,
                 interval_steps: int | None = None, interval_seconds: float | None = None,
                 on_done: Callable[[CheckpointInfo], None] | None = None, key: bytes | None = None):
        if keep < 1:
            raise CheckpointError(f"keep must be >= 1, got {keep}")
        if interval_steps is not None and interval_steps < 1:
            raise CheckpointError(f"interval_steps must be >= 1, got {interval_steps}")
        if interval_seconds is not None and interval_seconds <= 0:
            raise CheckpointError(f"interval_seconds must be > 0, got {interval_seconds}")
        self.directory, self.fingerprint, self.keep = directory, fingerprint, keep
        self._key = key or auth.load_key()
        self.interval_steps, self.interval_seconds = interval_steps, interval_seconds
        self._on_done = on_done
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._result: CheckpointInfo | None = None
        self._error: BaseException | None = None
        self._last_step: int | None = None
        self._last_time = time.monotonic()

    def due(self, step: int) -> bool:
        """True if an interval has elapsed since the last accepted submit (and none is running).

        Without any interval, always True."""
        if self.busy:
            return False
        if self.interval_steps is None and self.interval_seconds is None:
            return True
        if self.interval_steps is not None and (
                self._last_step is None and step % self.interval_steps == 0
                or self._last_step is not None and step - self._last_step >= self.interval_steps):
            return True
        return (self.interval_seconds is not None
                and time.monotonic() - self._last_time >= self.interval_seconds)

    @property
    def busy(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def submit(self, step: int, tensors: dict[str, torch.Tensor], meta: dict) -> bool:
        """Snapshot and start writing; False (and nothing done) if a write is in flight."""
        with self._lock:
            if self.busy:
                return False
            try:   # validate and deep-copy meta now: the caller may mutate it after we return
                meta_copy = json.loads(json.dumps(meta))
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"meta must be JSON-serialisable ({e})") from None
            snap = {}
            for k, v in tensors.items():
                if not isinstance(v, torch.Tensor):
                    raise CheckpointError(f"tensors[{k!r}] is a {type(v).__name__}, not a "
                                          f"Tensor: put non-tensor state into meta")
                snap[k] = v.detach().to("cpu", copy=True)
            self._last_step, self._last_time = step, time.monotonic()
            self._thread = threading.Thread(target=self._write, args=(step, snap, meta_copy),
                                            name=f"hotspare-ckpt-{step}", daemon=True)
            self._thread.start()
            return True

    def _write(self, step, snap, meta) -> None:
        try:
            info = save(self.directory, step, snap, meta, self.fingerprint, keep=self.keep, key=self._key)
        except BaseException as e:  # noqa: BLE001 -- handed to the caller in poll()
            with self._lock:
                self._error = e
            return
        if self._on_done is not None:
            try:
                self._on_done(info)
            except BaseException as e:  # noqa: BLE001 -- handed to the caller in poll()
                with self._lock:
                    self._error = e
            return
        with self._lock:
            self._result = info

    def poll(self) -> CheckpointInfo | None:
        """The checkpoint finished since the last poll, or None; a failed write raises here."""
        with self._lock:
            err, self._error = self._error, None
            info, self._result = self._result, None
        if err is not None:
            if isinstance(err, CheckpointError):
                raise err
            raise CheckpointError(f"background checkpoint write failed: "
                                  f"{type(err).__name__}: {err}") from err
        return info

    def wait(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Block until the in-flight write (if any) finishes, then ``poll()``."""
        t = self._thread
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                return None
        return self.poll()

    close = wait
