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

Refusal comes before any state is set: pickle's BUILD opcode (``__setstate__``, or setting
attributes) would otherwise let a pickle that is refused later set an attribute on an object
that outlives the load (an allowed class itself, the enum's members, our layout lookup). BUILD
is taken only on a fresh instance of one of DCP's dataclasses, with its own fields as the state
(``_check_build``); anything else is refused before it is applied. That check needs the
pure-Python unpickler (the C one has no hook per opcode): slower, and only run at restore time.
"""
from __future__ import annotations

import dataclasses
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


def _fields(module: str, name: str) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(getattr(importlib.import_module(module), name)))


# BUILD targets: DCP's dataclasses, by exact type, and the names their state may set.
_BUILDABLE = {getattr(importlib.import_module(m), n): _fields(m, n)
              for m, names in _ALLOWED.items() for n in names
              if dataclasses.is_dataclass(getattr(importlib.import_module(m), n, None))}
_TUPLE_STATE = {dcp_metadata.TensorProperties: 5}   # its __setstate__ takes a tuple of five


def _check_build(inst: Any, state: Any) -> None:
    """Refuse a BUILD (set ``state`` on ``inst``) unless ``inst`` is an instance of one of DCP's
    dataclasses and ``state`` holds only its own fields; checked before anything is set."""
    kind = type(inst)
    names = _BUILDABLE.get(kind)
    if names is None:
        raise UnsafeMetadata(f"it sets state on a {kind.__name__[:60]}, which DCP does not write")
    if kind in _TUPLE_STATE:
        if not (isinstance(state, tuple) and len(state) == _TUPLE_STATE[kind]):
            raise UnsafeMetadata(f"it sets a {kind.__name__} from something other than DCP's state")
        return
    if not isinstance(state, dict) or not all(isinstance(k, str) and k in names for k in state):
        got = sorted(map(str, state))[:5] if isinstance(state, dict) else type(state).__name__
        raise UnsafeMetadata(f"it sets {got} on a {kind.__name__}, which has no such fields")


class _Unpickler(pickle._Unpickler):   # the pure-Python one: its opcodes can be checked one by one
    dispatch = dict(pickle._Unpickler.dispatch)

    def _load_build(self) -> None:
        _check_build(self.stack[-2], self.stack[-1])
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build

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
