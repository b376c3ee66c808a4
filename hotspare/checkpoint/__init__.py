"""Optional asynchronous persistent checkpoints, used only when no in-memory copy survives.

See :mod:`hotspare.checkpoint.store` for the atomicity protocol and verification.
"""
from hotspare.checkpoint.store import (
    AsyncCheckpointer,
    CheckpointError,
    CheckpointInfo,
    fingerprint_of,
    latest,
    load,
    save,
    tensor_digest,
)

__all__ = ["AsyncCheckpointer", "CheckpointError", "CheckpointInfo", "fingerprint_of", "latest",
           "load", "save", "tensor_digest"]
