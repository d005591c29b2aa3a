"""Where checkpoints live on disk and which of them are complete.

    <run_dir>/<checkpoint.folder>/step-<N>/    a torch.distributed.checkpoint directory
                                  step-<N>/config.toml  the config it was written under
                                  step-<N>/COMPLETE   written last, once every rank finished:
                                                      JSON with the size and CRC-32 of each file
                                  step-<N>/NONFINITE  instead of COMPLETE: it holds NaN/inf
                                  abandoned-<time>/step-<M>/  moved aside by a load_step going back

A folder without COMPLETE is a save that crashed, is still being written or holds non-finite
values: it is never loaded and never counted for retention.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import torch

from torchllm.log import logger

# Dtypes a checkpoint's weights can be exported in (checkpoint.export_dtype, convert, hf).
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

MARKER = "COMPLETE"
NONFINITE = "NONFINITE"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(folder: Path, step: int) -> Path:
    return Path(folder) / f"step-{step}"


def step_of(path: Path) -> int | None:
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def write_durably(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically and durably: a temp file, fsync'd, renamed over
    `path`, then the folder fsync'd, so that after a crash or power loss `path` holds either
    its old content or all of `text` (never an empty or partial file)."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself
    finally:
        os.close(fd)


def mark_complete(path: Path, step: int, files: dict | None = None, **info) -> None:
    """Write the marker atomically and durably: it is the commit point of a save.

    `files` maps each file name to {"bytes": size, "crc32": hex} (verified at load); `info`
    adds more JSON fields (e.g. the run's global batch size and precision).
    """
    record = {"step": step, "time": time.time(), **info}
    if files is not None:
        record["files"] = files
    write_durably(Path(path) / MARKER, json.dumps(record, indent=1) + "\n")


class MarkerError(ValueError):
    """A COMPLETE marker that cannot be read or holds no record: its step is not used."""


def read_marker(path: Path) -> dict:
    """The COMPLETE marker's record; MarkerError (one line naming the marker) when it cannot be
    read, is empty or cut short, or is not the record `mark_complete` writes. Such a step is
    unusable: without its record the files' checksums cannot be verified."""
    marker = Path(path) / MARKER
    try:
        data = marker.read_bytes()
    except OSError as e:
        raise MarkerError(f"marker {marker} cannot be read ({e.strerror or e})") from None
    try:
        record = json.loads(data.decode())
    except ValueError as e:  # empty, cut short, or not text at all
        what = "empty" if not data.strip() else f"damaged (not a JSON record: {e})"
        raise MarkerError(f"marker {marker} is {what}") from None
    if not isinstance(record, dict) or "step" not in record:
        raise MarkerError(f"marker {marker} is damaged (no step record in it)")
    return record


def mark_nonfinite(path: Path, what: str) -> None:
    """Record why a finished save must never be loaded (it stays on disk for inspection)."""
    (Path(path) / NONFINITE).write_text(what + "\n")


def move_aside(folder: Path, after_step: int) -> tuple[list[int], Path | None]:
    """Move every step folder newer than `after_step` (complete or not) into one
    `abandoned-<time>` folder beside them; returns (moved steps, that folder)."""
    folder = Path(folder)
    newer = sorted(s for s in (step_of(c) for c in folder.iterdir() if c.is_dir())
                   if s is not None and s > after_step) if folder.is_dir() else []
    if not newer:
        return [], None
    dest = folder / time.strftime(f"abandoned-%Y%m%d-%H%M%S-after-step-{after_step}")
    dest.mkdir(parents=True, exist_ok=True)
    for step in newer:
        step_dir(folder, step).rename(dest / f"step-{step}")
    return newer, dest


def complete_steps(folder: Path, warn_incomplete: bool = False) -> list[int]:
    """Steps with a complete checkpoint in `folder`, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    steps = []
    for child in folder.iterdir():
        step = step_of(child)
        if step is None or not child.is_dir():
            continue
        if is_complete(child):
            steps.append(step)
        elif warn_incomplete and (child / NONFINITE).is_file():
            logger.warning("ignoring checkpoint %s: it holds non-finite values (%s)", child,
                           (child / NONFINITE).read_text().strip())
        elif warn_incomplete:
            logger.warning("ignoring incomplete checkpoint %s (no %s marker)", child, MARKER)
    return sorted(steps)


def resolve_checkpoint(path: str | Path, folder_name: str = "checkpoint") -> Path:
    """A complete step folder from a step folder, a checkpoint folder, or a run folder."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint path {path} is not a folder")
    if step_of(path) is not None:
        if not is_complete(path):
            raise FileNotFoundError(f"checkpoint {path} is incomplete (no {MARKER} marker)")
        return path
    for folder in (path, path / folder_name):
        steps = complete_steps(folder)
        if steps:
            return step_dir(folder, steps[-1])
    raise FileNotFoundError(
        f"no complete checkpoint under {path} (looked for step-<N>/{MARKER} in {path} and "
        f"{path / folder_name})"
    )


def checkpoint_config(step_path: Path) -> Path | None:
    """The config a step was written under: its own config.toml, else the run's
    (run/<folder>/step-N -> run/config.toml), else None. The step's wins: a later launch of the
    run (another shape, a failed resume of older code) may have rewritten the run's."""
    for path in (Path(step_path) / "config.toml", Path(step_path).parent.parent / "config.toml"):
        if path.is_file():
            return path
    return None
