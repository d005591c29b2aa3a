"""Where checkpoints live on disk and which of them are complete.

    <run_dir>/<checkpoint.folder>/step-<N>/    a torch.distributed.checkpoint directory
                                  step-<N>/config.toml  the config it was written under
                                  step-<N>/COMPLETE   written last, once every rank finished:
                                                      JSON with the size and CRC-32 of each file,
                                                      and what the step is (below)
                                  step-<N>/NONFINITE  instead of COMPLETE: it holds NaN/inf
                                  abandoned-<time>/step-<M>/  moved aside by a load_step going back

Step folder names are canonical: `step-<N>` with N in ASCII digits and no leading zero
(`step-4`, never `step-04`, `step-004` or another script's digits); any other `step-...` entry,
and an entry named like a step that is not a folder (a link), is ignored with a warning, never
loaded and never deleted. A deletion removes the entry scanned by its exact name (through
torchllm.store: a link is unlinked, never followed).

A folder without COMPLETE is a save that crashed, is still being written or holds non-finite
values: it is never loaded and never counted for retention (a resume deletes the ones without
either marker). `<checkpoint.folder>` may be an fsspec URL (s3://bucket/prefix): every function
here takes a local path or a URL, and does its file operations through `torchllm.storage`.
Reading a step (its marker, which step a run folder means, checks) is step.py's.

A complete step is a resume candidate unless its marker says otherwise (`not_resumable`):
`"weights_only": true` (a weights-only final save or seed: no optimizer, schedule or data
position) or `"healthy": false` (saved while the loss guard was skipping updates, or by its
stop: `"unhealthy"` says why). Such steps still load for inference and as initial weights when
named; a run folder given to inference or export resolves to its newest healthy step
(reader.resolve_checkpoint).
"""

from __future__ import annotations

import json
import re
import time
import torch

from torchllm.log import logger
from torchllm.storage import Location, as_location, join, name_of, parent_of, storage_for
from torchllm.store import Store

# Dtypes a checkpoint's weights can be exported in (checkpoint.export_dtype, convert, hf).
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

MARKER = "COMPLETE"
NONFINITE = "NONFINITE"
# Canonical step folder names only: one name per step (the cleanup deletes the name it scanned).
_STEP_DIR = re.compile(r"step-(0|[1-9][0-9]*)", re.ASCII)
_warned: set[tuple[str, str]] = set()  # (folder, entry) already warned about


def step_dir(folder: Location, step: int) -> Location:
    return join(as_location(folder), f"step-{step}")


def step_of(path: Location) -> int | None:
    match = _STEP_DIR.fullmatch(name_of(as_location(path)))
    return int(match.group(1)) if match else None


def write_durably(path: Location, text: str) -> None:
    """Replace `path` with `text` atomically and durably (storage.LocalStorage.write_durably: a
    temp file, fsync, rename, folder fsync; on an object store, one PUT)."""
    storage_for(path).write_durably(as_location(path), text)


def mark_complete(path: Location, step: int, files: dict | None = None, **info) -> None:
    """Write the marker atomically and durably: it is the commit point of a save.

    `files` maps each file name to {"bytes": size, "crc32": hex} (verified at load); `info`
    adds more JSON fields (e.g. the run's global batch size and precision).
    """
    record = {"step": step, "time": time.time(), **info}
    if files is not None:
        record["files"] = files
    write_durably(join(as_location(path), MARKER), json.dumps(record, indent=1) + "\n")


WEIGHTS_ONLY = "weights only: no optimizer, LR schedule or data position"


def not_resumable(record: dict) -> str | None:
    """Why the step of this marker record is no resume candidate (None: it is one)."""
    if record.get("weights_only"):
        return WEIGHTS_ONLY
    if record.get("healthy") is False:
        return record.get("unhealthy") or "saved while the loss guard skipped updates"
    return None


def mark_nonfinite(path: Location, what: str) -> None:
    """Record why a finished save must never be loaded (it stays on disk for inspection)."""
    write_durably(join(as_location(path), NONFINITE), what + "\n")


def delete_step(path: Location) -> None:
    """Delete a step folder (or prefix), its marker first: a step that is only partly deleted
    never looks complete."""
    path = as_location(path)
    parent, name = Store(parent_of(path)), name_of(path)
    if parent.kind(name) == "folder" or parent.remote:
        parent.remove(f"{name}/{MARKER}")
    parent.remove(name)  # this entry only: a link is unlinked, never followed


def move_aside(folder: Location, after_step: int,
               only: set[int] | None = None) -> tuple[list[int], Location | None]:
    """Move every step folder newer than `after_step` (complete or not; or only those in
    `only`) into one `abandoned-<time>` folder beside them; returns (moved steps, that folder)."""
    folder = as_location(folder)
    store = storage_for(folder)
    newer = sorted(s for s in map(step_of, store.scan(folder))
                   if s is not None and s > after_step and (only is None or s in only))
    if not newer:
        return [], None
    dest = join(folder, time.strftime(f"abandoned-%Y%m%d-%H%M%S-after-step-{after_step}"))
    for step in newer:
        store.move(step_dir(folder, step), join(dest, f"step-{step}"), first=MARKER)
    return newer, dest


def scan_steps(folder: Location) -> dict[int, str]:
    """{step: "complete" | "nonfinite" | "partial"} of every step folder in `folder`, from one
    listing (one LIST request on an object store)."""
    folder = as_location(folder)
    out = {}
    for name, files in _scan(folder).items():
        step = step_of(name)
        if step is None:
            if name.startswith("step-"):
                _warn_once(folder, name, "its name is not a step folder's (step-<N>: ASCII "
                                         "digits, no leading zero)")
            continue
        if files is None:
            _warn_once(folder, name, "it is not a folder (a link is never followed)")
            continue
        out[step] = ("complete" if MARKER in files else
                     "nonfinite" if NONFINITE in files else "partial")
    return out


def _scan(folder: Location) -> dict[str, set[str] | None]:
    """{entry: the names in it} of every subfolder of `folder` (None for an entry that is no
    folder: a link, a FIFO; a file is left out), links never followed."""
    store = Store(folder)
    if store.remote:
        return store.storage.scan(folder)
    out: dict[str, set[str] | None] = {}
    for name, kind in store.entries().items():
        if kind == "folder":
            out[name] = set(store.entries(name))
        elif kind != "file":
            out[name] = None
    return out


def _warn_once(folder: Location, name: str, why: str) -> None:
    if (str(folder), name) not in _warned:
        _warned.add((str(folder), name))
        logger.warning("ignoring %r in %s: %s; it is never loaded or deleted", name, folder, why)


def warn_unusable(folder: Location, steps: dict[int, str]) -> None:
    """One warning per step of `scan_steps` that is never loaded, with the reason."""
    for step, state in sorted(steps.items()):
        child = step_dir(folder, step)
        if state == "nonfinite":
            try:
                what = repr(Store(child).read_text(NONFINITE, max_bytes=4096).strip())
            except (OSError, UnicodeDecodeError) as e:
                what = f"its {NONFINITE} marker cannot be read: {e}"
            logger.warning("ignoring checkpoint %s: it holds non-finite values (%s)", child, what)
        elif state == "partial":
            logger.warning("ignoring incomplete checkpoint %s (no %s marker); deleting it", child,
                           MARKER)


def complete_steps(folder: Location, warn_incomplete: bool = False) -> list[int]:
    """Steps with a complete checkpoint in `folder`, oldest first."""
    steps = scan_steps(folder)
    if warn_incomplete:
        warn_unusable(as_location(folder), steps)
    return sorted(s for s, state in steps.items() if state == "complete")
