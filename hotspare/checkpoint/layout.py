"""A checkpoint directory's layout and the file-system steps that keep it atomic (see
``hotspare.checkpoint.store`` for the protocol): names, the ``step-<N>`` folders, ``LATEST``,
durable writes, pruning. No torch here."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
from dataclasses import dataclass

from hotspare.errors import HotspareError

FORMAT_VERSION = 2          # 2: authenticated (file digests + HMAC); 1 had neither
METADATA = ".metadata"      # DCP's metadata file (a pickle: parsed by checkpoint.metadata only)
# Caps on what is read from a checkpoint before it is authenticated, and what save() writes, so
# that every checkpoint save() made can be read back and nothing bigger is ever parsed. The
# sidecar holds ~100-250 bytes per tensor (its dtype and shape, its entry in the manifest) and
# the registry's non-tensor state: 16 MiB is room for some 70,000 tensors. DCP's .metadata
# holds ~200 bytes per tensor.
SIDECAR_MAX = 16 << 20
METADATA_MAX = 64 << 20
LATEST_MAX = 64             # "step-000001200\n"
SIDECAR = "hotspare.json"
LATEST = "LATEST"
STEP_RE = re.compile(r"^step-(\d{9,})$")
TMP_RE = re.compile(r"^\.tmp-step-(\d+)-(\d+)$")


class CheckpointError(HotspareError):
    """A checkpoint cannot be written, found or trusted. The message says what to do."""


@dataclass
class CheckpointInfo:
    path: str           # the step-<N> folder
    step: int
    fingerprint: str
    digest: str         # sha256 over the tensors (sorted keys, dtype, shape, bytes)
    nbytes: int         # bytes of tensor data
    saved_at: float     # time.time() when the write finished



def open_regular(path: str) -> int:
    """A read-only descriptor of ``path``, which must be a regular file: not a symbolic link, and
    never a FIFO or device, which could block the reader forever (refused with an OSError)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bounded(path: str, limit: int) -> bytearray:
    """The bytes of the regular file ``path``, refused (OSError, EFBIG) when it holds more than
    ``limit``: its size is read first, so an oversized file costs one ``fstat``, and no more than
    that size (+1, to see a file that grows meanwhile, also refused) is ever read."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise OSError(errno.EFBIG, f"{size} bytes, more than the {limit} hotspare writes or reads")
        buf, got = bytearray(size + 1), 0          # read in place: the file's bytes, once
        view = memoryview(buf)
        while got <= size:
            n = os.readv(fd, [view[got:]])
            if not n:
                break
            got += n
        view.release()
        if got > size:
            raise OSError(errno.EFBIG, "it grew while it was read")
        del buf[got:]
        return buf
    finally:
        os.close(fd)


def fingerprint_of(shapes: dict[str, tuple[str, list[int]]]) -> str:
    """sha256 of the sorted ``(key, dtype, shape)`` triples: identifies a job's model structure.

    ``dtype`` may be a string ("torch.float32") or a ``torch.dtype``.
    """
    items = [[k, str(d), [int(s) for s in shape]] for k, (d, shape) in sorted(shapes.items())]
    return hashlib.sha256(json.dumps(items, separators=(",", ":")).encode()).hexdigest()


def meta_digest(meta_json: str) -> str:
    return hashlib.sha256(meta_json.encode()).hexdigest()


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:     # e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file_durably(path: str, data: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def publish_step(directory: str, folder: str, step: int) -> str:
    """Publish the written, fsynced ``folder`` as step ``step``'s checkpoint of ``directory``,
    atomically (a rename; the same step written again, e.g. after a rollback, replaces the old
    one), then point LATEST at it. The published path."""
    final = os.path.join(directory, step_name(step))
    old = None
    if os.path.exists(final):
        old = os.path.join(directory, f".old-{step_name(step)}-{os.getpid()}")
        os.rename(final, old)
    os.rename(folder, final)
    fsync_dir(directory)
    latest_tmp = os.path.join(directory, f".{LATEST}.tmp-{os.getpid()}")
    write_file_durably(latest_tmp, step_name(step) + "\n")
    os.replace(latest_tmp, os.path.join(directory, LATEST))
    fsync_dir(directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def step_name(step: int) -> str:
    return f"step-{step:09d}"


def complete(directory: str) -> list[tuple[int, str]]:
    """(step, folder) of every ``step-*`` folder with a readable sidecar, oldest first."""
    try:
        names = os.listdir(directory)
    except OSError:              # gone, or no longer a directory
        return []
    out = []
    for name in names:
        m = STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(directory, name, SIDECAR)):
            out.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(out)


def latest_name(directory: str) -> str | None:
    try:
        name = read_bounded(os.path.join(directory, LATEST), LATEST_MAX).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if STEP_RE.match(name) else None


def prune(directory: str, keep: int, just_saved: int) -> None:
    """Keep the newest ``keep`` complete checkpoints (never the one LATEST names) and drop the
    remains of older crashed writes. Housekeeping after a published write: a directory that
    vanished or changed under it meanwhile is left for the next write to report."""
    protected = latest_name(directory)
    done = complete(directory)
    for _s, path in done[:-keep] if len(done) > keep else []:
        if os.path.basename(path) != protected:
            shutil.rmtree(path, ignore_errors=True)
    # Remains of crashed writes of an older step can never complete any more.
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        m = TMP_RE.match(name)
        if m and int(m.group(1)) < just_saved:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)



def within(path: str, roots) -> bool:
    """Whether ``path``, symbolic links resolved, lies inside one of ``roots`` (resolved too)."""
    real = os.path.realpath(path)
    for root in roots:
        if root:
            top = os.path.realpath(root)
            if real == top or real.startswith(top.rstrip(os.sep) + os.sep):
                return True
    return False


