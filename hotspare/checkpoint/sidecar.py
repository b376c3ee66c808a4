"""A checkpoint's authentication: the signed sidecar (``hotspare.json``) and the digest of every
file it lists, checked before any byte is deserialised, and the walk back to the newest checkpoint
that passes (see ``hotspare.checkpoint.store``). Nothing but JSON is parsed here; no torch.

The sidecar is authenticated before it is parsed, too: parsing JSON costs up to ~25 times its
bytes in memory (a planted 16 MiB file of ``[],`` took 385 MiB and seconds), so ``save`` writes
the very bytes the MAC covers (``signed``: canonical JSON) with the MAC appended as the last
field (``encode``), and ``read_sidecar`` checks that MAC over the raw bytes first. A sidecar not
in that form (written by an earlier hotspare, or edited) is parsed first as before, but only up
to ``LEGACY_MAX``.
"""
from __future__ import annotations

import hashlib
import json
import os
import re

from hotspare.checkpoint import auth
from hotspare.checkpoint.layout import (FORMAT_VERSION, METADATA, METADATA_MAX, SIDECAR, SIDECAR_MAX, STEP_RE,
                                        CheckpointError, CheckpointInfo, latest_name, read_bounded)

LEGACY_MAX = 1 << 20        # a sidecar that cannot be authenticated before it is parsed: ~25 MiB to parse
# The end of what ``encode`` writes: canonical JSON's last key is "version", then the MAC.
_TAIL = re.compile(rb'"version":(-?\d{1,9}),"mac":"([0-9a-f]{64})"\}\s*\Z')


def signed(side: dict) -> bytes:
    """The bytes the sidecar's MAC covers: every field but ``mac``, canonical JSON."""
    body = {k: v for k, v in side.items() if k != "mac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def encode(side: dict, key: bytes) -> bytes:
    """The sidecar file for ``side``, signed with ``key``: the signed bytes, then the MAC."""
    body = signed(side)
    return body[:-1] + b',"mac":"' + auth.mac(key, body).encode() + b'"}\n'


def _parse_signed(ckpt_dir: str, data: bytes, key: bytes) -> dict | None:
    """The sidecar in ``data`` if it is in the form ``encode`` writes (None if not), its MAC
    checked over the raw bytes before they are parsed."""
    m = _TAIL.search(data, max(0, len(data) - 128))
    if m is None:
        return None
    version = int(m.group(1))
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} has format version {version}; this hotspare reads version "
            f"{FORMAT_VERSION}: load it with the hotspare release that wrote it")
    if not auth.mac_ok(key, memoryview(data)[:m.end(1)], m.group(2).decode(), b"}"):
        raise _unsigned(ckpt_dir)
    side = json.loads(data[:m.end(1)] + b"}")
    side["mac"] = m.group(2).decode()
    return side


def _unsigned(ckpt_dir: str) -> CheckpointError:
    return CheckpointError(
        f"refused checkpoint {ckpt_dir}: its {SIDECAR} is not signed with this job's checkpoint "
        f"key ({auth.key_path()}): it was altered, or written by someone else or with another key "
        f"(pass that one with --checkpoint-key FILE)")


def read_sidecar(ckpt_dir: str, key: bytes) -> dict:
    """The authenticated ``hotspare.json`` of a checkpoint folder; CheckpointError if absent,
    unreadable, of another format version, or not signed with ``key``."""
    path = os.path.join(ckpt_dir, SIDECAR)
    try:             # bounded before anything else: the size is read first
        data = read_bounded(path, SIDECAR_MAX)
        side = _parse_signed(ckpt_dir, data, key)
        if side is None:
            if len(data) > LEGACY_MAX:
                raise CheckpointError(
                    f"refused checkpoint {ckpt_dir}: its {SIDECAR} ({len(data)} bytes) is not in the "
                    f"signed form this hotspare writes, and larger than the {LEGACY_MAX} bytes it "
                    f"parses before authenticating; if an earlier hotspare wrote it, load it with that "
                    f"release")
            side = json.loads(data)
    except FileNotFoundError:
        raise CheckpointError(
            f"not a hotspare checkpoint: {path} is missing (a checkpoint folder is the "
            f"'step-<N>' folder that save() wrote, or its parent directory)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(
            f"corrupt checkpoint {ckpt_dir}: {SIDECAR} cannot be read ({e}); load an older "
            f"checkpoint by passing its step-<N> folder, or delete this one") from None
    if not isinstance(side, dict) or "version" not in side:
        raise CheckpointError(f"corrupt checkpoint {ckpt_dir}: {SIDECAR} has no format version")
    if side["version"] == 1:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} was written by a hotspare that did not authenticate "
            f"checkpoints (format 1): it cannot be trusted; start from scratch, or load it with "
            f"that release if you know where it came from")
    if side["version"] != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} has format version {side['version']!r}; this hotspare "
            f"reads version {FORMAT_VERSION}: load it with the hotspare release that wrote it")
    if not auth.mac_ok(key, signed(side), side.get("mac")):
        raise _unsigned(ckpt_dir)
    for field, typ in (("step", int), ("fingerprint", str), ("digest", str), ("nbytes", int),
                       ("saved_at", (int, float)), ("tensors", dict), ("meta_digest", str),
                       ("files", dict)):
        if not isinstance(side.get(field), typ):
            raise CheckpointError(f"corrupt checkpoint {ckpt_dir}: {SIDECAR} lacks a valid "
                                  f"{field!r}")
    return side


def verified(ckpt_dir: str, key: bytes) -> tuple[dict, bytes]:
    """The sidecar and the DCP metadata bytes of a checkpoint whose every file is what its
    writer listed (see the module docstring); nothing is deserialised here but JSON."""
    side = read_sidecar(ckpt_dir, key)
    files = side["files"]
    try:
        present = set(os.listdir(ckpt_dir)) - {SIDECAR}
    except OSError as e:
        raise CheckpointError(f"corrupt checkpoint {ckpt_dir}: cannot list it ({e})") from None
    # A sharded checkpoint (checkpoint/sharded.py) has no DCP metadata: one header and one byte
    # file per rank, each listed here with its sha256.
    sharded = isinstance(side.get("meta"), dict) and side["meta"].get("kind") == "sharded"
    if present != set(files) or (METADATA not in files and not sharded):
        extra, missing = sorted(present - set(files)), sorted(set(files) - present)
        raise CheckpointError(f"corrupt checkpoint {ckpt_dir}: it holds other files than its writer "
                              f"listed (unexpected {extra}, missing {missing}); load an older checkpoint")
    metadata = b""
    for name, expected in sorted(files.items()):
        path = os.path.join(ckpt_dir, name)
        if os.path.islink(path) or not os.path.isfile(path):
            raise CheckpointError(f"corrupt checkpoint {ckpt_dir}: {name} is not a regular file")
        try:
            if name == METADATA:       # hashed from the very bytes that are parsed later
                metadata = read_bounded(path, METADATA_MAX)
                digest = hashlib.sha256(metadata).hexdigest()
            else:
                digest = auth.file_sha256(path)
        except OSError as e:
            raise CheckpointError(f"corrupt checkpoint {ckpt_dir}: {name} cannot be read ({e})") from None
        if digest != expected:
            raise CheckpointError(
                f"corrupt checkpoint {ckpt_dir}: {name} was changed after writing (sha256 {digest[:16]}, "
                f"signed {str(expected)[:16]}); load an older checkpoint by passing its step-<N> folder")
    return side, metadata


def verify(ckpt_dir: str, key: bytes | None = None) -> CheckpointInfo:
    """Check a ``step-<N>`` folder's MAC and every file's digest without deserialising anything."""
    return info_of(ckpt_dir, verified(ckpt_dir, key or auth.load_key())[0])


def info_of(ckpt_dir: str, side: dict) -> CheckpointInfo:
    return CheckpointInfo(path=ckpt_dir, step=side["step"], fingerprint=side["fingerprint"],
                          digest=side["digest"], nbytes=side["nbytes"],
                          saved_at=float(side["saved_at"]))


# --------------------------------------------------------------------------------------------
# find and load


def newest_valid(directory: str, key: bytes | None = None
                 ) -> tuple[CheckpointInfo | None, list[tuple[str, str]]]:
    """The newest checkpoint in ``directory`` that passes ``verify`` -- the one LATEST names
    first, then the ``step-*`` folders newest first -- and ``(folder, reason)`` for each newer
    one refused on the way. ``.tmp-*`` leftovers never count."""
    key = key or auth.load_key()
    try:
        names = [n for n in os.listdir(directory) if STEP_RE.match(n)]
    except OSError:
        names = []
    order = sorted(names, key=lambda n: int(STEP_RE.match(n).group(1)), reverse=True)
    first = latest_name(directory)
    if first in order:
        order.remove(first)
        order.insert(0, first)
    refused = []
    for name in order:
        path = os.path.join(directory, name)
        if os.path.islink(path):
            refused.append((path, f"{path} is a symbolic link, not a checkpoint this job wrote"))
            continue
        try:
            return verify(path, key), refused
        except CheckpointError as e:
            refused.append((path, str(e)))
    return None, refused


def latest(directory: str, key: bytes | None = None) -> CheckpointInfo | None:
    """The newest valid checkpoint in ``directory`` (see ``newest_valid``), or None."""
    return newest_valid(directory, key)[0]


