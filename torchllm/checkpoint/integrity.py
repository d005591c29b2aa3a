"""What keeps a bad checkpoint out: file checksums, non-finite values, disk space, and errors
that name their cause (which key, which shapes, which file, which rank).

All functions here are rank-local; the Checkpointer makes the ranks agree on their results.
"""

from __future__ import annotations

import errno

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from torchllm.checkpoint.layout import MARKER
from torchllm.storage import Location, as_location, name_of, parent_of, storage_for
from torchllm.store import NOT_REGULAR, Store, as_store


def file_crc32(path: Location) -> str:
    """CRC-32 of a file or object (a link is refused, never followed)."""
    path = as_location(path)
    return Store(parent_of(path)).crc32(name_of(path))


def folder_checksums(path: Location) -> dict[str, dict]:
    """{file name: {"bytes", "crc32"}} for every regular file of a checkpoint folder but the
    markers (links and other entries are no files of it)."""
    store = Store(path)
    return {name: {"bytes": size, "crc32": store.crc32(name)}
            for name, size in sorted(store.files().items())
            if name != MARKER and not name.startswith(f".{MARKER}")}


def verify_files(path: Location | Store, recorded: dict[str, dict], names: list[str]
                 ) -> str | None:
    """Check `names` (a share of the recorded files) against the marker; the first problem.
    Read through the step's Store: a link or FIFO among them is never followed or opened."""
    store = as_store(path)
    sizes = store.files() if names else {}
    for name in names:
        f = store.where(name)
        want = recorded[name]
        if name not in sizes:
            kind = store.kind(name)
            return f"file {f} is " + (f"{NOT_REGULAR[kind]}" if kind in NOT_REGULAR else
                                      "missing")
        size = sizes[name]
        if size != want["bytes"]:
            return f"file {f} has {size} bytes, {want['bytes']} when saved"
        crc = store.crc32(name)
        if crc != want["crc32"]:
            return f"file {f} is corrupted: CRC-32 {crc}, {want['crc32']} when saved"
    return None


def check_files(path: Location | Store, marker: dict, rank: int = 0, world: int = 1) -> str | None:
    """The first problem among this rank's share (every `world`-th name from `rank`) of the
    files the marker records; None when they all match, or the marker records none (a seed
    checkpoint written by convert or hf import)."""
    files = marker.get("files") or {}
    return verify_files(path, files, sorted(files)[rank::world]) if files else None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def tensors_of(obj) -> list[torch.Tensor]:
    """Every tensor in a nested state dict (this rank's shards of DTensors)."""
    if isinstance(obj, torch.Tensor):
        return [_local(obj)]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []


def nonfinite_and_bytes(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """(number of tensors holding NaN/inf, their total bytes) for this rank's tensors.

    `torch.isfinite(t).all()` of every floating-point tensor (a sum would overflow to inf for
    finite values past 3e38 in total: 1000 x 1e36 is finite), one host sync per device. A
    tensor subclass (torchao's 8-bit optimizer moments: uint8 codes, float scales and quantile
    map) is judged by its inner tensors (`__tensor_flatten__`): NaN or inf in any of them.
    """
    nbytes, flags = 0, {}
    for t in tensors:
        nbytes += t.numel() * t.element_size()
        finite = _all_finite(t.detach())
        if finite is not None:
            flags.setdefault(finite.device, []).append(finite)
    bad = sum(int((~torch.stack(f)).sum()) for f in flags.values())
    return bad, nbytes


def _all_finite(t: torch.Tensor) -> torch.Tensor | None:
    """A 0-d bool tensor: every value of t is finite (None: t holds no floating point)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        inner = [_all_finite(getattr(t, name)) for name in names]
        inner = [f.to(t.device) for f in inner if f is not None]
        return torch.stack(inner).all() if inner else None
    if not (t.is_floating_point() or t.is_complex()):
        return None
    return torch.isfinite(t).all()


def free_bytes(folder: Location) -> int | None:
    """Free bytes on the disk holding `folder` (None on an object store: no such limit)."""
    return storage_for(folder).free_bytes(as_location(folder))


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def describe_failure(e: BaseException) -> str:
    """One line per failing rank for a CheckpointException (which wraps every rank's error);
    `Type: message` otherwise."""
    if isinstance(e, CheckpointException):
        parts = []
        for rank, failure in sorted(e.failures.items()):
            exc = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {rank}: {_first_line(exc)}")
        return "; ".join(parts) or _first_line(e)
    return _first_line(e)


def is_disk_full(e: BaseException) -> bool:
    """ENOSPC anywhere in `e` (its causes, a CheckpointException's ranks), or torch.save's
    short write on a full disk ("[enforce fail at inline_container.cc] . unexpected pos N vs
    M": PyTorchStreamWriter checks the position after each write and carries no errno)."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, tuple):  # CheckpointException: (exception, traceback summary)
            todo.append(x[0])
            continue
        if isinstance(x, OSError) and x.errno == errno.ENOSPC:
            return True
        if "unexpected pos" in str(x) or "No space left on device" in str(x):
            return True
        if isinstance(x, CheckpointException):
            todo.extend(x.failures.values())
        todo.extend([x.__cause__, x.__context__])
    return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


# Optimizer state per parameter byte (before the first step the state is empty): AdamW's two
# moments, Muon's momentum, AdamW8bit's two 8-bit moments.
STATE_PER_PARAM_BYTE = {"AdamW": 2.0, "Adam": 2.0, "Muon": 1.0, "AdamW8bit": 0.5}


def state_estimate(model: torch.nn.Module, optimizer) -> int:
    """This rank's bytes of a save: its shards of the weights, plus the optimizer state's (its
    measured size once it exists, else STATE_PER_PARAM_BYTE's estimate)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    params = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    if optimizer is None:
        return params
    total = params
    for opt in getattr(optimizer, "optimizers", [optimizer]):
        state = [local(v) for s in opt.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)]
        if state:
            total += sum(t.numel() * t.element_size() for t in state)
            continue
        mine = sum(local(p).numel() * local(p).element_size()
                   for g in opt.param_groups for p in g["params"])
        total += int(mine * STATE_PER_PARAM_BYTE.get(type(opt).__name__, 1.0))
    return total
