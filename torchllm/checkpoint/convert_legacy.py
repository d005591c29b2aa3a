"""One-time conversion of a checkpoint written by an older torchllm (its index and its small
states pickled) to today's (all data: checkpoint/index.py, checkpoint/state.py):

    python -m torchllm.checkpoint.convert_legacy --checkpoint PATH

PATH: a step folder, or a checkpoint or run folder (every complete step in it). This UNPICKLES
the old files, which can run code: run it only on a checkpoint you trust (one you wrote
yourself). Each step's files are read whole, written anew beside it, then swapped in; its
COMPLETE marker is rewritten last with the new files' sizes and CRC-32s (its other fields kept).
A step already in today's format is left as it is.
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchllm.checkpoint.index import INDEX, dcp_writer
from torchllm.checkpoint.integrity import folder_checksums
from torchllm.checkpoint.layout import MARKER, complete_steps, step_dir, step_of
from torchllm.checkpoint.state import encode
from torchllm.checkpoint.step import read_marker

PICKLED = ".pickle"  # the key under which an older torchllm pickled a small state


def is_legacy(step: Path) -> bool:
    """Whether the step's index is a pickle (DCP's own, as an older torchllm wrote it)."""
    with open(step / INDEX, "rb") as f:
        return f.read(64).lstrip()[:1] != b"{"


class _TrustedPlanner(DefaultLoadPlanner):
    """DCP's planner, values unpickled as saved (the user trusts this checkpoint)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.original_state_dict[read_item.dest_index.fqn] = torch.load(value,
                                                                        weights_only=False)


def _read_all(step: Path) -> dict:
    """Every tensor and value of an old step, flat (DCP's flattened keys)."""
    reader = FileSystemReader(str(step))
    metadata = reader.read_metadata()  # DCP's own unpickling: the user trusts this step
    state = {fqn: torch.empty(meta.size, dtype=meta.properties.dtype)
             if isinstance(meta, TensorStorageMetadata) else None
             for fqn, meta in metadata.state_dict_metadata.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, planner=_TrustedPlanner(flatten_state_dict=False),
                 no_dist=True)
    return state


def _as_data(state: dict) -> dict:
    """The flat state with every pickled small state (`<key>.pickle`) as a JSON text
    (`<key>.json`, what state.JSONState reads)."""
    out = {}
    for fqn, value in state.items():
        if fqn.endswith(PICKLED) and isinstance(value, bytes):
            fqn = fqn[: -len(PICKLED)] + ".json"
            value = json.dumps(encode(pickle.loads(value)))  # noqa: S301 - trusted, as said
        out[fqn] = value
    return out


def convert_step(step: Path) -> bool:
    """Convert one old-format step in place; False when it is in today's format already."""
    if not is_legacy(step):
        return False
    marker = read_marker(step)
    state = _as_data(_read_all(step))
    new = step.with_name(f".{step.name}.converting")
    shutil.rmtree(new, ignore_errors=True)
    dcp.save(state, storage_writer=dcp_writer(new), no_dist=True)
    (step / MARKER).unlink()  # uncommitted while its files change: never loaded half-done
    for old in step.iterdir():
        if old.name == INDEX or old.suffix == ".distcp":
            old.unlink()
    for made in new.iterdir():
        made.rename(step / made.name)
    new.rmdir()
    if marker.get("files") is not None:
        marker["files"] = folder_checksums(step)
    (step / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    return True


def steps_of(path: Path) -> list[Path]:
    """The step folders PATH names: itself, or every complete step of a checkpoint or run
    folder."""
    if step_of(path) is not None:
        return [path]
    for folder in (path, path / "checkpoint"):
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
        done = convert_step(step)
        print(f"{step}: {'converted' if done else 'already in the current format'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
