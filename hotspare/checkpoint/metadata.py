"""Reading torch.distributed.checkpoint's ``.metadata`` without running code.

DCP writes its metadata as a pickle, and ``pickle.load`` runs whatever a pickle names. Here
the pickle is read by an unpickler that resolves only the classes DCP itself writes for a
flat dict of tensors (torch 2.13: the dataclasses of ``torch.distributed.checkpoint.metadata``,
the file system planner's ``_StorageInfo``, ``torch.Size``, dtypes, layouts, the memory-format
enum, ``pathlib`` paths); any other global is refused (``UnsafeMetadata``, which the store
reports as a ``CheckpointError``). Bytes entries
(``BytesStorageMetadata``: objects DCP would ``torch.load`` as pickles) are refused too, since
hotspare never writes them. ``VerifiedReader`` is a ``FileSystemReader`` whose
``read_metadata`` returns metadata parsed this way from bytes the caller has already
authenticated (see ``auth``), so nothing re-reads the file in between.
"""
from __future__ import annotations

import importlib
import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata


class UnsafeMetadata(Exception):
    """The metadata is not what DCP writes for hotspare (turned into a CheckpointError)."""


def _layout(name: str) -> torch.layout:
    """Stands in for ``torch.serialization._get_layout``: a layout from its name, nothing else."""
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise UnsafeMetadata(f"unknown layout {name!r}")
    return value


# What torch 2.13's DCP pickles for a flat dict of CPU tensors, found by recording find_class
# on real checkpoints. Dataclass constructors, an enum, torch.Size and a path: none of them
# does anything but hold the values it is given.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},
}
_REPLACED = {("torch.serialization", "_get_layout"): _layout}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _REPLACED:
            return _REPLACED[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)             # torch.float32, torch.strided, ...
        if name in _ALLOWED.get(module, ()):
            return getattr(importlib.import_module(module), name)
        raise UnsafeMetadata(f"it names {module}.{name}, which DCP does not write for hotspare")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadata("it holds a persistent id")


def parse(data: bytes, files: set[str]) -> Metadata:
    """DCP metadata from ``data`` without running code; every tensor must live in ``files``."""
    try:
        md = _Unpickler(io.BytesIO(data)).load()
    except UnsafeMetadata:
        raise
    except Exception as e:   # noqa: BLE001 -- a damaged pickle fails in many ways
        raise UnsafeMetadata(f"it cannot be parsed ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise UnsafeMetadata("it is not DCP metadata")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            raise UnsafeMetadata(f"entry {key!r} is a {type(entry).__name__}; hotspare writes tensors only")
    for where in (md.storage_data or {}).values():
        if getattr(where, "relative_path", None) not in files:
            raise UnsafeMetadata(f"it points at {getattr(where, 'relative_path', None)!r}, not a "
                                 "file of this checkpoint")
    return md


class VerifiedReader(FileSystemReader):
    """A ``FileSystemReader`` that takes its metadata from authenticated bytes, parsed by
    :func:`parse`, instead of unpickling ``.metadata`` from disk."""

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = self._metadata
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
