"""One-time conversion of a checkpoint written by an older torchllm (its index and its small
states pickled) to today's (all data: checkpoint/index.py, checkpoint/state.py):

    python -m torchllm.checkpoint.convert_legacy --checkpoint PATH

PATH: a local step folder, or a checkpoint or run folder (every complete step in it). Nothing
in the old step runs: its files are first checked against the sizes and CRC-32s its COMPLETE
marker recorded (a mismatch is refused: resealing it would make the change pass every later
check), its pickles are read by an unpickler that builds only DCP's index classes and plain
values (checkpoint/legacy_pickle.py; anything else is refused, naming the file and the global),
its stored values with PyTorch's weights_only loader. The new step is written BESIDE the old
one (`step-N.converting`, never a `step-<N>` name: a resume ignores it), fsync'd, its COMPLETE
written last, then swapped in (one atomic exchange of the two folders where the file system
has it, else the old renamed to `step-N.legacy` and the new renamed in) and the old removed.
Interrupted at any point, `step-N` is the old step or the new one, complete; a rerun finishes
or redoes the conversion. A step already in today's format is left as it is. Refusals: exit 2,
one line.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchllm.checkpoint.index import (
    INDEX,
    DataPlanner,
    dcp_reader,
    dcp_writer,
    untrusted_cause,
)
from torchllm.checkpoint.index_read import INDEX_CAP
from torchllm.checkpoint.integrity import check_files, describe_failure, folder_checksums
from torchllm.checkpoint.layout import MARKER, complete_steps, step_dir, step_of
from torchllm.checkpoint.legacy_pickle import LegacyRefused, legacy_index, legacy_state
from torchllm.checkpoint.state import encode
from torchllm.checkpoint.step import MarkerError, read_marker
from torchllm.store import Store

PICKLED = ".pickle"  # the key under which an older torchllm pickled a small state
CONVERTING, OLD = ".converting", ".legacy"  # the new step beside the old; the old, set aside


class Refused(ValueError):
    """A step convert_legacy will not convert: one line naming the file and why."""


def is_legacy(step: Path) -> bool:
    """Whether the step's index is not JSON (a pickle, as an older torchllm wrote it)."""
    with Store(step).open(INDEX) as f:
        return f.read(64).lstrip()[:1] != b"{"


def _read_all(step: Path, marker: dict) -> dict:
    """Every tensor and value of an old step, flat (DCP's flattened keys), read as data."""
    files = marker.get("files") or {}
    recorded = files.get(INDEX, {}).get("bytes") if isinstance(files, dict) else None
    where = f"{step / INDEX}"
    data = Store(step).read_bytes(INDEX, max_bytes=recorded if type(recorded) is int
                                  else INDEX_CAP)
    metadata = legacy_index(data, where)
    state = {fqn: torch.empty(meta.size, dtype=meta.properties.dtype)
             if isinstance(meta, TensorStorageMetadata) else None
             for fqn, meta in metadata.state_dict_metadata.items()}
    reader = dcp_reader(str(step), metadata)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, planner=DataPlanner(reader), no_dist=True)
    return state


def _as_data(state: dict, step: Path) -> dict:
    """The flat state with every pickled small state (`<key>.pickle`) as a JSON text
    (`<key>.json`, what state.JSONState reads), unpickled as plain values only."""
    out = {}
    for fqn, value in state.items():
        if fqn.endswith(PICKLED) and isinstance(value, bytes):
            value = json.dumps(encode(legacy_state(value, f"{step} (value {fqn})")))
            fqn = fqn[: -len(PICKLED)] + ".json"
        out[fqn] = value
    return out


def _fsync_folder(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders atomically (Linux renameat2 RENAME_EXCHANGE); False where the file
    system or C library has no such call."""
    rename = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if rename is None:
        return False
    at_fdcwd, exchange = -100, 2
    if rename(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def swap_in(step: Path, new: Path) -> None:
    """Make the complete `new` the step `step`, then remove the old one: at every moment
    `step` is one of the two (except, without an atomic exchange, between two renames, which
    `finish_swaps` completes)."""
    if _exchange(new, step):  # `new` now holds the old step
        _fsync_folder(step.parent)
        Store(step.parent).remove(new.name)
        return
    aside = step.with_name(step.name + OLD)
    step.rename(aside)
    new.rename(step)
    _fsync_folder(step.parent)
    Store(step.parent).remove(aside.name)


def finish_swaps(folder: Path) -> None:
    """What a conversion cut short left in `folder`: the complete new step moved in (stopped
    between its two renames), then every `step-N.converting` / `step-N.legacy` beside a
    complete `step-N` removed (a new step half written, or the old one set aside)."""
    for entry in sorted(folder.glob(f"step-*{CONVERTING}")):
        step = entry.with_name(entry.name[: -len(CONVERTING)])
        if step_of(step) is not None and not step.exists() and (entry / MARKER).is_file() \
                and step.with_name(step.name + OLD).is_dir():
            entry.rename(step)
            _fsync_folder(folder)
    for entry in sorted([*folder.glob(f"step-*{CONVERTING}"), *folder.glob(f"step-*{OLD}")]):
        step = entry.with_name(entry.name[: -len(entry.suffix)])
        if step_of(step) is not None and (step / MARKER).is_file():
            Store(folder).remove(entry.name)


def convert_step(step: Path) -> bool:
    """Convert one old-format step (beside it, then swapped in); False when it is in today's
    format already. Refused (one line) for a step whose files differ from its marker's record
    or whose pickles hold anything but data."""
    if not is_legacy(step):
        return False
    try:
        marker = read_marker(step)
    except MarkerError as e:
        raise Refused(str(e)) from None
    if problem := check_files(step, marker):
        raise Refused(f"{step} is not converted: {problem} (its files no longer match its "
                      f"{MARKER} marker; converting would reseal the change)")
    state = _as_data(_read_all(step, marker), step)
    new = step.with_name(step.name + CONVERTING)
    parent = Store(step.parent)
    parent.remove(new.name)  # a conversion cut short before
    for name, kind in Store(step).entries().items():  # config.toml and the like
        if kind == "file" and name != MARKER and not name.startswith(".") \
                and not name.endswith(".distcp"):
            Store(new).write_bytes(name, Store(step).read_bytes(name))
    dcp.save(state, storage_writer=dcp_writer(str(new)), no_dist=True)  # files fsync'd
    _fsync_folder(new)
    if marker.get("files") is not None:
        marker["files"] = folder_checksums(new)
    Store(new).write_text(MARKER, json.dumps(marker, indent=1) + "\n")  # fsync'd, last
    swap_in(step, new)
    return True


def steps_of(path: Path) -> list[Path]:
    """The step folders PATH names: itself, or every complete step of a checkpoint or run
    folder."""
    if step_of(path) is not None:
        finish_swaps(path.parent)
        return [path] if (path / MARKER).is_file() else []
    for folder in (path, path / "checkpoint"):
        if folder.is_dir():
            finish_swaps(folder)
        steps = complete_steps(folder) if folder.is_dir() else []
        if steps:
            return [Path(step_dir(folder, s)) for s in steps]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchllm.checkpoint.convert_legacy", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=Path,
                        help="a step folder, or a checkpoint or run folder (all its steps)")
    args = parser.parse_args(argv)
    steps = steps_of(args.checkpoint)
    if not steps:
        print(f"error: no complete checkpoint step at or under {args.checkpoint}",
              file=sys.stderr)
        return 2
    for step in steps:
        try:
            done = convert_step(step)
        except (Refused, LegacyRefused, OSError, ValueError, CheckpointException) as e:
            if isinstance(e, CheckpointException):  # a chunk or value refused, or unreadable
                e = untrusted_cause(e) or describe_failure(e)
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"{step}: {'converted' if done else 'already in the current format'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
