"""A step's index, written and read as data: DCP's `Metadata` (where each tensor chunk and each
stored value lies) encoded as JSON in the step's `.metadata`, never as a pickle.

DCP's own writer pickles its index and its reader unpickles it, so a checkpoint copied from
elsewhere could run code (or, through allow-listed classes, change them) in every command that
reads it. Here `JsonIndexWriter.finish` writes the index as JSON, `decode_index` rebuilds it
from a closed set of field types (anything else: `CorruptCheckpoint`, one line naming the
file), and `StepReader` hands DCP the index that `step.Step` already read and checked, so DCP
never opens `.metadata` itself. Non-tensor values (RNG states, torchllm's JSON states) are
stored by DCP with torch.save and read back by `DataPlanner` with PyTorch's maintained
`weights_only` unpickler (plus NumPy's array for NumPy's RNG state), never a plain one; a
tensor chunk or value it refuses stops the read with `UntrustedRead`, one line naming the
file, the entry and the global (`StepReader.read_data`, `load_value`).

An index written by torchllm before this (a pickle: only a file that starts like one) is
refused in one line naming `convert_legacy`, the one-time conversion, which reads it through an
allow-list (legacy_pickle.py). The read itself is bounded (index_read.py).
"""

from __future__ import annotations

import io
import json
import pickle
from functools import lru_cache

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from torchllm.checkpoint.legacy_pickle import looks_like_pickle, refused_what
from torchllm.config.job_config import ConfigError
from torchllm.storage import Location, storage_for

INDEX = ".metadata"
FORMAT = "torchllm-dcp-index/1"
CONVERT = "python -m torchllm.checkpoint.convert_legacy --checkpoint {path}"


class CorruptCheckpoint(ValueError):
    """A checkpoint file differs from what its COMPLETE marker recorded, or its index is not
    one this reader can use (a path outside the step, a read past a file's end)."""


class UntrustedCheckpoint(ConfigError):
    """A checkpoint holds something other than data (a pickle index from an older torchllm, or
    a stored value that names code): refused before it runs, on every rank (a ConfigError, so a
    resume stops instead of falling back to an older step)."""

    def __init__(self, message: str):
        super().__init__(message, "checkpoint")


class UntrustedRead(UntrustedCheckpoint, CheckpointException):
    """An UntrustedCheckpoint found by a DCP read (`step.Step.read`): one line, and still the
    CheckpointException (every rank's failures) that DCP's read raises."""

    def __init__(self, message: str, failures: dict):
        UntrustedCheckpoint.__init__(self, message)
        self._failures = failures

    def __str__(self) -> str:
        return self.args[0]


def legacy_refusal(where: str, step: Location) -> UntrustedCheckpoint:
    return UntrustedCheckpoint(
        f"{where} is not a checkpoint file torchllm trusts: it is no JSON index (a pickle, as an "
        "older torchllm wrote it, is never read here: it can run code); if this is an older "
        f"torchllm's checkpoint, convert it once with: {CONVERT.format(path=step)} (it checks "
        "the CRC-32s and builds DCP's index classes and plain values only)")


# ------------------------------------------------------------------------ the JSON encoding

_KINDS = (torch.dtype, torch.layout, torch.memory_format)
# The dtypes a checkpoint's tensors may have: plain numbers (no quantized or bit types).
STORED_DTYPES = {d for d in vars(torch).values() if isinstance(d, torch.dtype) and (
    d.is_floating_point or d in (torch.complex64, torch.complex128, torch.bool, torch.uint8,
                                 torch.int8, torch.int16, torch.int32, torch.int64))}
_CONSTANTS = {str(v): v for v in vars(torch).values() if isinstance(v, _KINDS)
              and (not isinstance(v, torch.dtype) or v in STORED_DTYPES)}
MAX_INT = 2**63 - 1  # the largest size or offset a tensor (int64) can have


def encode_index(md: Metadata) -> str:
    tensors, values = {}, []
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            p = meta.properties
            tensors[fqn] = {"dtype": str(p.dtype), "layout": str(p.layout),
                            "memory_format": str(p.memory_format),
                            "requires_grad": p.requires_grad, "pin_memory": p.pin_memory,
                            "size": list(meta.size),
                            "chunks": [[list(c.offsets), list(c.sizes)] for c in meta.chunks]}
        else:
            values.append(fqn)
    storage = [{"fqn": i.fqn, "offset": None if i.offset is None else list(i.offset),
                "index": i.index, "file": s.relative_path, "at": s.offset, "length": s.length,
                "transforms": None if s.transform_descriptors is None
                else list(s.transform_descriptors)}
               for i, s in md.storage_data.items()]
    planner = {k: list(v) for k, v in (md.planner_data or {}).items()}
    save_id = md.storage_meta.save_id if md.storage_meta else None
    return json.dumps({"format": FORMAT, "version": md.version, "save_id": save_id,
                       "tensors": tensors, "values": values, "storage": storage,
                       "planner_data": planner}, separators=(",", ":"))


class _Bad(ValueError):
    pass


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise _Bad(what)


def _ints(value, what: str) -> list[int]:
    _need(isinstance(value, list) and all(type(v) is int and 0 <= v <= MAX_INT for v in value),
          f"{what} {_shown(value)} is not a list of integers from 0 to 2**63 - 1")
    return value


def _shown(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _constant(name, kind: type, what: str):
    value = _CONSTANTS.get(name) if isinstance(name, str) else None
    _need(isinstance(value, kind), f"{what} {_shown(name)} is not a torch {kind.__name__}"
          + (" of plain numbers (no quantized type)" if kind is torch.dtype else ""))
    return value


def _tensor(fqn: str, t) -> TensorStorageMetadata:
    _need(isinstance(t, dict), f"tensor {fqn!r} is not a record")
    props = TensorProperties(
        dtype=_constant(t.get("dtype"), torch.dtype, f"tensor {fqn!r}: dtype"),
        layout=_constant(t.get("layout"), torch.layout, f"tensor {fqn!r}: layout"),
        requires_grad=t.get("requires_grad") is True,
        memory_format=_constant(t.get("memory_format"), torch.memory_format,
                                f"tensor {fqn!r}: memory_format"),
        pin_memory=t.get("pin_memory") is True)
    chunks = t.get("chunks")
    _need(isinstance(chunks, list) and all(isinstance(c, list) and len(c) == 2 for c in chunks),
          f"tensor {fqn!r}: chunks are not [offsets, sizes] pairs")
    return TensorStorageMetadata(
        props, torch.Size(_ints(t.get("size"), f"tensor {fqn!r}: size")),
        [ChunkStorageMetadata(torch.Size(_ints(o, f"tensor {fqn!r}: a chunk's offsets")),
                              torch.Size(_ints(s, f"tensor {fqn!r}: a chunk's sizes")))
         for o, s in chunks])


def _storage(entry) -> tuple[MetadataIndex, _StorageInfo]:
    _need(isinstance(entry, dict), "a storage entry is not a record")
    fqn = entry.get("fqn")
    _need(isinstance(fqn, str), "a storage entry has no fqn")
    offset, index = entry.get("offset"), entry.get("index")
    name, at, length = entry.get("file"), entry.get("at"), entry.get("length")
    transforms = entry.get("transforms")
    _need(isinstance(name, str) and type(at) is int and type(length) is int
          and 0 <= at <= MAX_INT and 0 <= length <= MAX_INT,
          f"the storage entry of {fqn!r} has no file, offset and length (integers from 0 to "
          "2**63 - 1)")
    _need(index is None or type(index) is int, f"the storage entry of {fqn!r}: bad index")
    _need(transforms is None or (isinstance(transforms, list)
                                 and all(isinstance(t, str) for t in transforms)),
          f"the storage entry of {fqn!r}: transforms are not names")
    key = MetadataIndex(fqn, None if offset is None else
                        torch.Size(_ints(offset, f"the storage entry of {fqn!r}: offset")), index)
    return key, _StorageInfo(name, at, length, transforms)


def decode_index(data: bytes, where: str, step: Location) -> Metadata:
    """The `Metadata` a JSON index records. UntrustedCheckpoint for a pickle (an older
    torchllm's); CorruptCheckpoint (one line naming `where`) for anything else that is not
    exactly what `encode_index` writes."""
    if data.lstrip()[:1] != b"{":
        if looks_like_pickle(data):  # DCP's own pickle, as torchllm wrote it before
            raise legacy_refusal(where, step)
        raise CorruptCheckpoint(f"checkpoint index {where} cannot be used: it is neither a JSON "
                                f"index nor a pickle (it starts with {data[:8]!r})")
    try:
        record = json.loads(data.decode())
        _need(isinstance(record, dict) and record.get("format") == FORMAT,
              f"not a torchllm index (format {FORMAT!r})")
        tensors, values = record.get("tensors"), record.get("values")
        storage, planner = record.get("storage"), record.get("planner_data")
        _need(isinstance(tensors, dict) and isinstance(values, list)
              and all(isinstance(v, str) for v in values) and isinstance(storage, list)
              and isinstance(planner, dict), "its tensors, values, storage or planner_data "
                                             "are missing")
        sdm = {fqn: _tensor(fqn, t) for fqn, t in tensors.items()}
        sdm.update({fqn: BytesStorageMetadata() for fqn in values})
        for fqn, path in planner.items():
            _need(isinstance(path, list) and all(type(p) in (str, int) for p in path),
                  f"planner_data of {fqn!r} is not a key path")
        version, save_id = record.get("version"), record.get("save_id")
        _need(version is None or isinstance(version, str), "its version is not a string")
        return Metadata(sdm, planner_data={k: tuple(v) for k, v in planner.items()},
                        storage_data=dict(map(_storage, storage)), version=version,
                        storage_meta=StorageMeta(save_id=save_id if isinstance(save_id, str)
                                                 else None))
    except (_Bad, ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(f"checkpoint index {where} cannot be used: {e}") from None
    except RecursionError:
        raise CorruptCheckpoint(f"checkpoint index {where} cannot be used: it is nested too "
                                "deeply (an index is a few levels deep)") from None


# ------------------------------------------------------------------------ writing


class JsonIndexWriter:
    """Mixin for DCP's FileSystemWriter / FsspecWriter: `finish` writes the index as JSON."""

    def finish(self, metadata: Metadata, results) -> None:
        # As _FileSystemWriter.finish (torch 2.13), with json instead of pickle.dump.
        metadata.version = "1.0.0"
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        metadata.storage_meta = self.storage_meta()
        path = self.fs.concat_path(self.path, INDEX)
        tmp = self.fs.concat_path(self.path, INDEX + ".tmp")
        with self.fs.create_stream(tmp, "wb") as f:
            f.write(encode_index(metadata).encode())
            if self.sync_files:
                import os

                os.fsync(f.fileno())
        if self.fs.exists(path):
            self.fs.rm_file(path)
        self.fs.rename(tmp, path)


class _LocalWriter(JsonIndexWriter, FileSystemWriter):
    pass


def check_reads(where: str, metadata: Metadata, sizes: dict[str, int]) -> None:
    """Every read the index `where` records stays inside the step: a file COMPLETE lists (a
    plain name: no folder, no `..`), and an (offset, length) within its recorded size."""
    for index, info in metadata.storage_data.items():
        name, at, length = info.relative_path, info.offset, info.length
        what = f"checkpoint index {where}: the entry of {index.fqn!r}"
        if name in ("", ".", "..") or "/" in name or "\\" in name or name not in sizes \
                or name == INDEX:
            raise CorruptCheckpoint(f"{what} reads {name!r}, which is not a file of the step "
                                    f"(COMPLETE lists {sorted(sizes)})")
        if at < 0 or length < 0 or at + length > sizes[name]:
            raise CorruptCheckpoint(f"{what} reads bytes {at}..{at + length} of {name}, which "
                                    f"has {sizes[name]} bytes")


@lru_cache(maxsize=None)
def _fsspec_classes() -> tuple[type, type]:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return (type("JsonFsspecWriter", (JsonIndexWriter, FsspecWriter), {"__module__": __name__}),
            type("StepFsspecReader", (StepReader, FsspecReader), {"__module__": __name__}))


def dcp_writer(location: Location):
    """DCP's writer for a step folder, its index written as JSON: the file system's (fsync'd
    files) for a local path, the fsspec one for a URL (no fsync: it means nothing for an
    upload, and falls back to a machine-wide sync())."""
    store = storage_for(location)
    if not store.remote:
        return _LocalWriter(str(location))
    return _fsspec_classes()[0](str(location), sync_files=False, **store.options)


# ------------------------------------------------------------------------ reading


def _numpy_globals() -> list:
    """What torch.save of NumPy's RNG state (a uint32 array) needs beyond weights_only's own."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    return [(reconstruct, "numpy._core.multiarray._reconstruct"),
            (reconstruct, "numpy.core.multiarray._reconstruct"),  # written under NumPy 1.x
            np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_value(data: bytes, where: str):
    """A non-tensor value DCP stored with torch.save, loaded with weights_only=True."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise untrusted(where, "a stored value", e) from None


def untrusted(where: str, what: str, error: BaseException) -> UntrustedCheckpoint:
    """The refusal of a value or chunk PyTorch's weights_only loader would not build."""
    return UntrustedCheckpoint(
        f"{where} is not a checkpoint file torchllm trusts: {what} {refused_what(error)} "
        "(checkpoints are data, never code; see docs/checkpointing.md, What is trusted)")


class DataPlanner(DefaultLoadPlanner):
    """DCP's load planner, its stored values loaded with `load_value` (DCP's own uses
    weights_only=False)."""

    def __init__(self, reader: StepReader):
        super().__init__()
        self._reader = reader

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        name = self._reader.storage_data[read_item.storage_index].relative_path
        where = f"{self._reader.fs.concat_path(self._reader.path, name)} " \
                f"(value {read_item.dest_index.fqn})"
        obj = load_value(value.read(), where)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class StepReader:
    """Mixin for DCP's FileSystemReader / FsspecReader over a step whose index was read and
    checked already (`step.Step`): DCP gets that index, and never reads `.metadata` itself."""

    def use_index(self, metadata: Metadata) -> StepReader:
        self._index = metadata
        return self

    def read_metadata(self, *args, **kwargs) -> Metadata:
        self._index.storage_meta = StorageMeta(save_id=self._index.storage_meta.save_id,
                                               load_id=self.load_id)
        return self._index

    def _slice_file(self, file, sinfo):
        self._reading = sinfo  # the entry whose bytes are read now (named if refused)
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):
        """DCP's read; a tensor chunk weights_only refuses (a pickle that names code):
        UntrustedCheckpoint naming the file and the entry."""
        self._reading = None
        try:
            return super().read_data(plan, planner)
        except pickle.UnpicklingError as e:
            info = self._reading
            fqn = next((i.fqn for i, s in self.storage_data.items() if s is info), "?")
            name = info.relative_path if info is not None else "?"
            where = f"{self.fs.concat_path(self.path, name)} (tensor {fqn})"
            raise untrusted(where, "a tensor chunk", e) from None


class _LocalReader(StepReader, FileSystemReader):
    pass


def dcp_reader(location: Location, metadata: Metadata, storage=None):
    """DCP's reader for a step folder or prefix whose checked index is `metadata` (`storage`:
    its file system, when the caller bound it already)."""
    store = storage or storage_for(location)
    if store.remote:
        return _fsspec_classes()[1](str(location), **store.options).use_index(metadata)
    return _LocalReader(str(location)).use_index(metadata)


def untrusted_cause(e: BaseException) -> str | None:
    """The refusal inside `e` (DCP wraps each rank's read errors in a CheckpointException)."""
    if isinstance(e, UntrustedCheckpoint):
        return str(e)
    for failure in getattr(e, "failures", {}).values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, UntrustedCheckpoint):
            return str(exc)
    return None
