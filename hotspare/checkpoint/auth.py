"""The checkpoint key: what makes a checkpoint this user's own and not something planted.

Every checkpoint's sidecar lists the sha256 of each file the checkpoint holds (``.metadata``
and the tensor files included) and carries an HMAC-SHA256 over itself under a secret key.
Nothing in a checkpoint is deserialised before that MAC and those digests check out, so a
checkpoint written or altered by anyone without the key is refused, not read.

The key lives in a file outside every checkpoint directory (so ``--resume`` works in a later
job, and copying a checkpoint somewhere does not copy its key):

* ``--checkpoint-key FILE`` (``hotspare run``), else ``$HOTSPARE_CHECKPOINT_KEY``, else
  ``~/.config/hotspare/checkpoint.key``;
* created on first use with 32 random bytes (hex), mode 0600, its folder 0700;
* refused when group or others may read or write it, when another user owns it, or when it
  is not a regular file (a symbolic link included).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

from hotspare.checkpoint.layout import open_regular
from hotspare.errors import ConfigError

ENV_KEY = "HOTSPARE_CHECKPOINT_KEY"        # the key *file* (a path), never the key itself
DEFAULT_KEY_FILE = os.path.join("~", ".config", "hotspare", "checkpoint.key")
_KEY_BYTES = 32


class CheckpointKeyError(ConfigError):
    """The checkpoint key file is missing, unsafe or unreadable; the message says what to do."""


def key_path(path: str | None = None) -> str:
    """The key file in use: ``path``, else ``$HOTSPARE_CHECKPOINT_KEY``, else the default."""
    return os.path.abspath(os.path.expanduser(path or os.environ.get(ENV_KEY) or DEFAULT_KEY_FILE))


def load_key(path: str | None = None, create: bool = True) -> bytes:
    """Read the checkpoint key (creating it, 0600, when ``create`` and it does not exist)."""
    path = key_path(path)
    if create and not os.path.lexists(path):
        _create(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)    # a FIFO would block
    except FileNotFoundError:
        raise CheckpointKeyError(
            f"checkpoint key {path} does not exist: use the key file the checkpoints were written "
            f"with (--checkpoint-key FILE or ${ENV_KEY})") from None
    except OSError as e:
        raise CheckpointKeyError(f"cannot open the checkpoint key {path} ({e}); it must be a regular "
                                 f"file, not a symbolic link") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointKeyError(f"checkpoint key {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise CheckpointKeyError(f"checkpoint key {path} belongs to another user (uid {st.st_uid}): use "
                                     f"a key file of your own (--checkpoint-key FILE)")
        if st.st_mode & 0o077:
            raise CheckpointKeyError(
                f"checkpoint key {path} is readable or writable by group/others (mode "
                f"{stat.S_IMODE(st.st_mode):o}): run chmod 600 {path}")
        raw = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) < _KEY_BYTES:
        raise CheckpointKeyError(
            f"checkpoint key {path} does not hold a key ({_KEY_BYTES} or more bytes in hex): delete "
            f"it to have a new one made (checkpoints written with the old key can then not be read)")
    return key


def _create(path: str) -> None:
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return                      # another process made it first: read theirs
    except OSError as e:
        raise CheckpointKeyError(f"cannot create the checkpoint key {path} ({e}): choose a writable "
                                 f"place with --checkpoint-key FILE") from None
    try:
        os.write(fd, (secrets.token_hex(_KEY_BYTES) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def mac(key: bytes, data: bytes, *more: bytes) -> str:
    """HMAC-SHA256 of ``data`` followed by ``more`` (pieces: no copy of a large buffer)."""
    h = hmac.new(key, data, hashlib.sha256)
    for piece in more:
        h.update(piece)
    return h.hexdigest()


def mac_ok(key: bytes, data: bytes, expected: str, *more: bytes) -> bool:
    return (isinstance(expected, str) and expected.isascii()
            and hmac.compare_digest(mac(key, data, *more), expected))


def file_sha256(path: str) -> str:
    """The sha256 of the regular file ``path`` (a FIFO or device is refused, never waited on)."""
    h = hashlib.sha256()
    with open(open_regular(path), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
