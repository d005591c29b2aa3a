"""The pickles an older torchllm wrote (a step's `.metadata`, DCP's own index, and its small
states `<key>.pickle`), read as data by `convert_legacy`: an unpickler that builds only the
DCP index classes (or, for a small state, only numbers, strings and containers) and refuses
anything else in one line naming the file and the global it found.

PyTorch's `weights_only` unpickler would be the maintained choice, but it reads protocol 2
only, and DCP pickles its index with protocol 4 (frames, memoization, STACK_GLOBAL). So this is
Python's own pure-Python unpickler with the four opcodes that build or call narrowed:

- GLOBAL / STACK_GLOBAL (`find_class`): only the names in the allow-list, nothing imported;
- REDUCE (a call): only the allow-listed classes and functions;
- NEWOBJ / NEWOBJ_EX: only the allow-listed classes;
- BUILD (sets attributes): only on an instance of an allow-listed class, never on a class or a
  function (a BUILD on `pathlib.PosixPath` itself once rewrote it for the whole process);
- INST / OBJ (protocol 0/1 object building) and persistent ids: refused.
"""

from __future__ import annotations

import io
import pickle
import re
from collections import OrderedDict
from pathlib import PurePosixPath

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.serialization import _get_layout


class LegacyRefused(pickle.UnpicklingError):
    """A legacy pickle holding something other than the data it should: one line naming it."""


def _posix_path(*parts: str) -> PurePosixPath:
    """DCP's StorageMeta records the path it was saved to (pathlib.PosixPath): a pure path."""
    if not all(isinstance(p, str) for p in parts):
        raise LegacyRefused("a pathlib.PosixPath of something other than text")
    return PurePosixPath(*parts)


_INDEX_CLASSES = (dcp_metadata.Metadata, dcp_metadata.TensorStorageMetadata,
                  dcp_metadata.ChunkStorageMetadata, dcp_metadata.TensorProperties,
                  dcp_metadata.BytesStorageMetadata, dcp_metadata.MetadataIndex,
                  dcp_metadata.StorageMeta, dcp_metadata._MEM_FORMAT_ENCODING, _StorageInfo)
_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}

# {(module, name): object} a legacy index may name; the callables among them build data only.
INDEX_GLOBALS = {
    **{(c.__module__, c.__qualname__): c for c in _INDEX_CLASSES},
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("pathlib", "PosixPath"): _posix_path,
    ("collections", "OrderedDict"): OrderedDict,
    **{("torch", name): dtype for name, dtype in _DTYPES.items()},
}
# A small state (`<key>.pickle`): plain numbers, strings and containers.
STATE_GLOBALS = {("collections", "OrderedDict"): OrderedDict}

_D = pickle._Unpickler.dispatch  # noqa: SLF001 - the pure-Python unpickler's opcode table


class _Restricted(pickle._Unpickler):  # noqa: SLF001
    def __init__(self, data: bytes, allowed: dict):
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self.allowed = allowed
        self.callables = [v for v in allowed.values() if callable(v)]
        self.classes = tuple(v for v in allowed.values() if isinstance(v, type))
        self.names = {id(v): f"{m}.{n}" for (m, n), v in allowed.items()}

    def _name(self, obj) -> str:
        return self.names.get(id(obj)) or getattr(obj, "__qualname__", type(obj).__name__)

    def find_class(self, module: str, name: str):
        found = self.allowed.get((module, name))
        if found is None:
            raise LegacyRefused(f"names {module}.{name} (code, not the data it should hold)")
        return found

    def persistent_load(self, pid):
        raise LegacyRefused("holds a persistent id (a reference outside the file)")

    def _refuse(self, what: str):
        raise LegacyRefused(what)

    def _callable(self, func, what: str) -> None:
        if not any(func is c for c in self.callables):
            raise LegacyRefused(f"{what} {self._name(func)}, which is not on the allow-list")

    dispatch = dict(_D)

    def load_reduce(self):
        self._callable(self.stack[-2], "calls")
        _D[pickle.REDUCE[0]](self)

    def load_newobj(self):
        self._callable(self.stack[-2], "builds")
        _D[pickle.NEWOBJ[0]](self)

    def load_newobj_ex(self):
        self._callable(self.stack[-3], "builds")
        _D[pickle.NEWOBJ_EX[0]](self)

    def load_build(self):
        inst = self.stack[-2]
        if isinstance(inst, type) or not isinstance(inst, self.classes):
            what = self._name(inst) if isinstance(inst, type) or callable(inst) \
                else f"a {type(inst).__name__}"
            raise LegacyRefused(f"sets the attributes of {what} (code, not data)")
        _D[pickle.BUILD[0]](self)

    def load_inst(self):
        self._refuse("builds an object the protocol-0 way (INST)")

    def load_obj(self):
        self._refuse("builds an object the protocol-1 way (OBJ)")

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.INST[0]] = load_inst
    dispatch[pickle.OBJ[0]] = load_obj


def loads(data: bytes, allowed: dict, where: str):
    """The value the pickle `data` holds, built with `allowed` only; LegacyRefused (one line
    naming `where` and what it found) for anything else, or for bytes that are no pickle."""
    try:
        return _Restricted(data, allowed).load()
    except LegacyRefused as e:
        raise LegacyRefused(f"{where} {e}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
            AttributeError, RecursionError, MemoryError, OverflowError) as e:
        raise LegacyRefused(f"{where} is not a readable pickle ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None


def legacy_index(data: bytes, where: str) -> dcp_metadata.Metadata:
    """A legacy `.metadata` (DCP's pickled Metadata), built from the index classes only."""
    value = loads(data, INDEX_GLOBALS, where)
    if not isinstance(value, dcp_metadata.Metadata):
        raise LegacyRefused(f"{where} holds a {type(value).__name__}, not DCP's Metadata")
    return value


def legacy_state(data: bytes, where: str):
    """A legacy small state (`<key>.pickle`): numbers, strings and containers only."""
    return loads(data, STATE_GLOBALS, where)


# ------------------------------------------------------------------------ recognising a pickle

# A pickle's first opcode: PROTO 2-5 (what DCP and torch.save write), or a protocol 0/1 start.
_PICKLE_STARTS = {b"(", b"c", b"}", b"]", b")"}


def looks_like_pickle(data: bytes) -> bool:
    """Whether `data` starts as a pickle does (PROTO 2..5, or MARK / GLOBAL / an empty
    container): zeros, text or random bytes do not."""
    if data[:1] == b"\x80":
        return len(data) > 1 and 2 <= data[1] <= 5
    return data[:1] in _PICKLE_STARTS


_ADVICE = re.compile(r"\s*(Please use|Check the documentation|Re-running|\(\d\)).*", re.S)


def refused_what(error: BaseException) -> str:
    """What PyTorch's weights_only loader refused, for a one-line message: the global it named
    (`names os.system`), else its own reason; never its advice to load with
    weights_only=False."""
    text = str(error)
    found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"unrecognized function (\S+)", text)
    if found:
        return f"names {found.group(1).rstrip('.')} (code, not data)"
    reason = text.split("WeightsUnpickler error:", 1)
    reason = _ADVICE.sub("", reason[1]).strip() if len(reason) == 2 else ""
    return f"is not plain data ({reason.splitlines()[0].rstrip('.') if reason else type(error).__name__})"
