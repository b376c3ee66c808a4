"""Optional asynchronous persistent checkpoints, used only when no in-memory copy survives.

See :mod:`hotspare.checkpoint.store` for the atomicity protocol and verification; `layout` holds the
directory's names and file-system steps, `sidecar` the authentication (neither imports torch).
"""
from hotspare.checkpoint.store import (
    AsyncCheckpointer,
    CheckpointError,
    CheckpointInfo,
    fingerprint_of,
    latest,
    load,
    newest_valid,
    save,
    tensor_digest,
    verify,
    within,
)
from hotspare.checkpoint.auth import CheckpointKeyError, key_path, load_key

__all__ = ["AsyncCheckpointer", "CheckpointError", "CheckpointInfo", "CheckpointKeyError", "fingerprint_of",
           "key_path", "latest", "load", "load_key", "newest_valid", "save", "tensor_digest", "verify", "within"]
