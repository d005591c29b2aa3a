"""Where checkpoints live on disk and which of them are complete.

    <run_dir>/<checkpoint.folder>/step-<N>/    a torch.distributed.checkpoint directory
                                  step-<N>/COMPLETE   written last, once every rank finished

A folder without COMPLETE is a save that crashed or is still being written: it is never loaded
and never counted for retention.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from torchllm.log import logger

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(folder: Path, step: int) -> Path:
    return Path(folder) / f"step-{step}"


def step_of(path: Path) -> int | None:
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def mark_complete(path: Path, step: int) -> None:
    """Write the marker atomically (temp file + rename): it is the commit point of a save."""
    tmp = Path(path) / f".{MARKER}.tmp"
    tmp.write_text(json.dumps({"step": step, "time": time.time()}) + "\n")
    tmp.replace(Path(path) / MARKER)


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
