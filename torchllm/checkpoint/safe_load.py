"""Checkpoints are data, never code: every pickle in a checkpoint is read by an unpickler that
builds only the types on an allow-list, and refuses anything else with one line naming the file.

A plain unpickler calls whatever a pickle names (`os.system` included), so a checkpoint copied
from elsewhere would run code in every command that reads it. A DCP checkpoint of ours holds
three kinds of pickle, each read here:
- `.metadata` (DCP's index: where each tensor chunk lies): `read_metadata`, DCP's metadata and
  storage classes, torch.Size, dtypes, layouts and memory formats (METADATA_GLOBALS);
- the non-tensor values in the `.distcp` files (optimizer hyperparameters, RNG states, the
  states below), each a `torch.save`: `load_bytes`, torch.load(weights_only=True) plus NumPy's
  array reconstruction for NumPy's RNG state (DCP's own planner uses weights_only=False);
- torchllm's own small states (`state.PickledState`: scheduler, data loader position,
  counters, loss guard): `load_state_pickle`, containers of numbers and strings only.

`SafeReader`s (what `reader.dcp_reader(path)` returns) apply the first two to every DCP
load, so no caller can forget them.
"""

from __future__ import annotations

import io
import pickle
from functools import lru_cache
from typing import IO

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from torchllm.config.job_config import ConfigError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
METADATA_GLOBALS = {
    *((_DCP_METADATA, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name ("torch.strided")
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"),
    ("_codecs", "encode"),  # bytes under pickle protocol 2
}
# torchllm's own states: plain containers of numbers, strings, bytes and tensors (a scheduler's
# state may hold a tensor learning rate: the tensor's storage is read with weights_only=True).
STATE_GLOBALS = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                 ("builtins", "complex"), ("_codecs", "encode"),
                 ("torch._utils", "_rebuild_tensor_v2"), ("torch.storage", "_load_from_bytes")}


def _storage_from_bytes(data: bytes):
    """torch.storage._load_from_bytes (which unpickles anything) as a weights-only load."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


SAFE_STANDINS = {("torch.storage", "_load_from_bytes"): _storage_from_bytes}


def _torch_constants() -> set[tuple[str, str]]:
    """("torch", name) of every dtype, layout and memory format (torch.float32, torch.strided)."""
    kinds = (torch.dtype, torch.layout, torch.memory_format)
    return {("torch", name) for name, value in vars(torch).items() if isinstance(value, kinds)}


METADATA_GLOBALS |= _torch_constants()


class UntrustedCheckpoint(ConfigError):
    """A checkpoint file holds something other than data: refused before it runs, on every rank
    (a ConfigError, so a resume stops instead of falling back to an older step)."""

    def __init__(self, message: str):
        super().__init__(message, "checkpoint")


def _refusal(where: str, what: str) -> UntrustedCheckpoint:
    return UntrustedCheckpoint(
        f"{where} is not a checkpoint file torchllm trusts: it asks to build {what}, which is "
        "not on the allow-list of data types (checkpoints are data, never code; see "
        "docs/checkpointing.md, What is trusted)")


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the (module, name) globals in `allowed`."""

    def __init__(self, stream: IO[bytes], allowed: set[tuple[str, str]], where: str):
        super().__init__(stream)
        self.allowed, self.where = allowed, where

    def find_class(self, module: str, name: str):
        if (module, name) not in self.allowed:
            raise _refusal(self.where, f"{module}.{name}")
        return SAFE_STANDINS.get((module, name)) or super().find_class(module, name)

    def persistent_load(self, pid):
        raise _refusal(self.where, "a persistent object")


def restricted_load(data: bytes | IO[bytes], allowed: set[tuple[str, str]], where: str):
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        return RestrictedUnpickler(stream, allowed, where).load()
    except UntrustedCheckpoint:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or damaged: one line naming the file
        raise ValueError(f"{where} cannot be read ({type(e).__name__}: {e})") from None


def load_state_pickle(data: bytes, where: str):
    """A `PickledState` value: containers of numbers, strings and bytes, nothing callable."""
    return restricted_load(data, STATE_GLOBALS, where)


def _numpy_globals() -> list:
    """What torch.save of NumPy's RNG state (a uint32 array) needs beyond weights_only's own."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    return [(reconstruct, "numpy._core.multiarray._reconstruct"),
            (reconstruct, "numpy.core.multiarray._reconstruct"),  # written under NumPy 1.x
            np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_bytes(data: bytes, where: str):
    """A non-tensor value DCP stored with torch.save, loaded with weights_only=True."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).split("WeightsUnpickler error:", 1)[-1].strip().splitlines()
        raise UntrustedCheckpoint(
            f"{where} is not a checkpoint file torchllm trusts: a stored value "
            f"{first[0] if first else 'needs an unsafe global'} (checkpoints are data, never "
            "code; see docs/checkpointing.md, What is trusted)") from None


class _SafeBytesPlanner:
    """The load planner DCP passes to `read_data`, whose bytes values are loaded with
    `load_bytes` and handed on re-saved (the planner's own torch.load sees only what
    torch.save wrote from those plain values)."""

    def __init__(self, planner, reader: FileSystemReader):
        self._planner, self._reader = planner, reader

    def __getattr__(self, name):
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        reader = self._reader
        name = reader.storage_data[read_item.storage_index].relative_path
        where = f"{reader.fs.concat_path(reader.path, name)} (value {read_item.dest_index.fqn})"
        obj = load_bytes(value.read(), where)
        if read_item.dest_index.fqn.endswith(".pickle") and isinstance(obj, bytes):
            load_state_pickle(obj, where)  # a PickledState's value: refused here, file named
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)


class SafeReader:
    """Mixin for DCP's FileSystemReader / FsspecReader: `.metadata` through the restricted
    unpickler, bytes values through `load_bytes`; the rest is DCP's (tensors are already
    read with weights_only=True)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        # As FileSystemReader.read_metadata (torch 2.13), with pickle.load restricted.
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = restricted_load(stream.read(), METADATA_GLOBALS, str(path))
        if not isinstance(metadata, Metadata):
            raise _refusal(str(path), f"a {type(metadata).__name__} instead of DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        return super().read_data(plan, _SafeBytesPlanner(planner, self))


class SafeFileSystemReader(SafeReader, FileSystemReader):
    pass


@lru_cache(maxsize=None)
def _fsspec_reader_class() -> type:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # needs fsspec

    return type("SafeFsspecReader", (SafeReader, FsspecReader), {"__module__": __name__})


def safe_fsspec_reader(path: str, **options):
    return _fsspec_reader_class()(path, **options)


def untrusted_cause(e: BaseException) -> str | None:
    """The refusal inside `e` (DCP wraps each rank's read errors in a CheckpointException)."""
    if isinstance(e, UntrustedCheckpoint):
        return str(e)
    for failure in getattr(e, "failures", {}).values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, UntrustedCheckpoint):
            return str(exc)
    return None
