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
either marker). `<checkpoint.folder>` may be an fsspec URL (s3://bucket/prefix): a checkpoint
folder is bound once as `StepFolders` (a torchllm.store Store: file system + root), which the
retention, the saver and the resume share; the module's functions taking a path are the same
operations for one call. The marker's record (`parse_marker`, `recorded_sizes`) and which step
a run, checkpoint or step folder means (`resolve_checkpoint`) are here too; reading a step's
index and tensors is step.py's.

A complete step is a resume candidate unless its marker says otherwise (`not_resumable`):
`"weights_only": true` (a weights-only final save or seed: no optimizer, schedule or data
position) or `"healthy": false` (saved while the loss guard was skipping updates, or by its
stop: `"unhealthy"` says why). Such steps still load for inference and as initial weights when
named; a run folder given to inference or export resolves to its newest healthy step
(`resolve_checkpoint`).
"""

from __future__ import annotations

import json
import re
import time
import torch

from torchllm.log import logger
from torchllm.storage import Location, as_location, join, name_of, parent_of, shown, storage_for
from torchllm.store import Store, as_store

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


class MarkerError(ValueError):
    """A COMPLETE marker that cannot be read or holds no record: its step is not used."""


def read_marker(path: Location | Store) -> dict:
    """The COMPLETE marker's record; MarkerError (one line naming the marker) when it cannot be
    read, is empty or cut short, or is not the record `mark_complete` writes. Such a step is
    unusable: without its record the files' checksums cannot be verified."""
    store = as_store(path)
    marker = store.where(MARKER)
    try:
        data = store.storage.read_bytes(marker)
    except OSError as e:
        data = e
    return parse_marker(data, marker)


def parse_marker(data: bytes | OSError, where) -> dict:
    """The record in a COMPLETE marker's bytes (`read_marker`)."""
    if isinstance(data, OSError):
        raise MarkerError(f"marker {where} cannot be read ({data.strerror or data})")
    try:
        record = json.loads(data.decode())
    except ValueError as e:  # empty, cut short, or not text at all
        what = "empty" if not data.strip() else f"damaged (not a JSON record: {e})"
        raise MarkerError(f"marker {where} is {what}") from None
    except RecursionError:
        raise MarkerError(f"marker {where} is damaged (nested too deeply)") from None
    if not isinstance(record, dict) or "step" not in record:
        raise MarkerError(f"marker {where} is damaged (no step record in it)")
    return record


def recorded_sizes(marker: dict, present: dict[str, int], where: str) -> dict[str, int]:
    """{file: bytes} of the step: as COMPLETE records them (a file it does not list is no part
    of the step), or with checksums off (no list) as the folder holds them (`present`)."""
    files = marker.get("files")
    if not files:
        return present
    if not isinstance(files, dict) or not all(
            isinstance(f, dict) and type(f.get("bytes")) is int for f in files.values()):
        raise MarkerError(f"marker {where} is damaged (its file list is not "
                          "{name: {bytes, crc32}})")
    return {name: f["bytes"] for name, f in files.items()}


def mark_nonfinite(path: Location, what: str) -> None:
    """Record why a finished save must never be loaded (it stays on disk for inspection)."""
    write_durably(join(as_location(path), NONFINITE), what + "\n")


class StepFolders:
    """A checkpoint folder (`<run>/<checkpoint.folder>`, a local path or a URL) bound ONCE as a
    Store (file system + root): its steps scanned, named, opened, moved aside and deleted
    through that one store, never resolved again."""

    def __init__(self, folder: Location | Store):
        self.store = as_store(folder)
        self.root = self.store.root

    def __str__(self) -> str:
        return str(self.root)

    def __repr__(self) -> str:
        return f"StepFolders({self.root})"

    def step_path(self, step: int) -> Location:
        """The step folder's location (for messages and writers)."""
        return join(self.root, f"step-{step}")

    def step_store(self, step: int) -> Store:
        """The step folder as a Store on this folder's file system."""
        return Store(self.step_path(step), self.store.storage)

    def scan(self) -> dict[int, str]:
        """{step: "complete" | "nonfinite" | "partial"} of every step folder, from one listing
        (one LIST request on an object store)."""
        out = {}
        for name, files in self._entries().items():
            step = step_of(name)
            if step is None:
                if name.startswith("step-"):
                    _warn_once(self.root, name, "its name is not a step folder's (step-<N>: "
                                                "ASCII digits, no leading zero)")
                continue
            if files is None:
                _warn_once(self.root, name, "it is not a folder (a link is never followed)")
                continue
            out[step] = ("complete" if MARKER in files else
                         "nonfinite" if NONFINITE in files else "partial")
        return out

    def _entries(self) -> dict[str, set[str] | None]:
        """{entry: the names in it} of every subfolder (None for an entry that is no folder: a
        link, a FIFO; a file is left out), links never followed."""
        store = self.store
        if store.remote:
            return store.storage.scan(self.root)
        out: dict[str, set[str] | None] = {}
        for name, kind in store.entries().items():
            if kind == "folder":
                out[name] = set(store.entries(name))
            elif kind != "file":
                out[name] = None
        return out

    def complete(self, warn_incomplete: bool = False) -> list[int]:
        """Steps with a complete checkpoint, oldest first."""
        steps = self.scan()
        if warn_incomplete:
            self.warn_unusable(steps)
        return sorted(s for s, state in steps.items() if state == "complete")

    def delete(self, step: int | str) -> None:
        """Delete a step folder (or prefix; `step` or the entry's name), its marker first: a
        step that is only partly deleted never looks complete."""
        name = step if isinstance(step, str) else f"step-{step}"
        if self.store.kind(name) == "folder" or self.store.remote:
            self.store.remove(f"{name}/{MARKER}")
        self.store.remove(name)  # this entry only: a link is unlinked, never followed

    def move_aside(self, after_step: int, only: set[int] | None = None
                   ) -> tuple[list[int], Location | None]:
        """Move every step folder newer than `after_step` (complete or not; or only those in
        `only`) into one `abandoned-<time>` folder beside them; returns (moved steps, that
        folder)."""
        storage = self.store.storage
        newer = sorted(s for s in map(step_of, storage.scan(self.root))
                       if s is not None and s > after_step and (only is None or s in only))
        if not newer:
            return [], None
        dest = join(self.root,
                    time.strftime(f"abandoned-%Y%m%d-%H%M%S-after-step-{after_step}"))
        for step in newer:
            storage.move(self.step_path(step), join(dest, f"step-{step}"), first=MARKER)
        return newer, dest

    def newest_healthy(self, steps: list[int]) -> Location:
        """The newest of `steps` whose weights were saved while training was healthy
        (inference and export of a run folder; a step named explicitly is read as it is): a
        step saved while the loss guard skipped updates holds the weights that made them. The
        newest step when none is."""
        for step in reversed(steps):
            path = self.step_path(step)
            try:
                unhealthy = read_marker(self.step_store(step)).get("healthy") is False
            except MarkerError:
                unhealthy = False  # the reader names the marker's problem
            if not unhealthy:
                if step != steps[-1]:
                    logger.warning("reading %s: the newer steps %s were saved while the loss "
                                   "guard skipped updates (name one to read it anyway)", path,
                                   [s for s in steps if s > step])
                return path
        return self.step_path(steps[-1])

    def warn_unusable(self, steps: dict[int, str]) -> None:
        """One warning per step of `scan` that is never loaded, with the reason."""
        for step, state in sorted(steps.items()):
            child = self.step_path(step)
            if state == "nonfinite":
                try:
                    what = repr(self.step_store(step).read_text(NONFINITE, max_bytes=4096).strip())
                except (OSError, UnicodeDecodeError) as e:
                    what = f"its {NONFINITE} marker cannot be read: {e}"
                logger.warning("ignoring checkpoint %s: it holds non-finite values (%s)", child,
                               what)
            elif state == "partial":
                logger.warning("ignoring incomplete checkpoint %s (no %s marker); deleting it",
                               child, MARKER)


def as_folders(folder: Location | StepFolders) -> StepFolders:
    """`folder` bound as StepFolders (as it is when it is already)."""
    return folder if isinstance(folder, StepFolders) else StepFolders(folder)


def delete_step(path: Location) -> None:
    """Delete a step folder (or prefix), its marker first (`StepFolders.delete`)."""
    path = as_location(path)
    StepFolders(parent_of(path)).delete(name_of(path))


def move_aside(folder: Location, after_step: int,
               only: set[int] | None = None) -> tuple[list[int], Location | None]:
    """`StepFolders.move_aside` of `folder`."""
    return StepFolders(folder).move_aside(after_step, only)


def scan_steps(folder: Location) -> dict[int, str]:
    """`StepFolders.scan` of `folder`."""
    return StepFolders(folder).scan()


def _warn_once(folder: Location, name: str, why: str) -> None:
    if (str(folder), name) not in _warned:
        _warned.add((str(folder), name))
        logger.warning("ignoring %r in %s: %s; it is never loaded or deleted", name, folder, why)


def warn_unusable(folder: Location, steps: dict[int, str]) -> None:
    """`StepFolders.warn_unusable` of `folder`."""
    StepFolders(folder).warn_unusable(steps)


def complete_steps(folder: Location, warn_incomplete: bool = False) -> list[int]:
    """Steps with a complete checkpoint in `folder`, oldest first (`StepFolders.complete`)."""
    return StepFolders(folder).complete(warn_incomplete)


def resolve_checkpoint(path: Location | Store, folder_name: str = "checkpoint") -> Location:
    """A complete step folder from a step folder, a checkpoint folder, or a run folder (each a
    local path or a URL), bound once: its store's file system answers every question."""
    store = as_store(path)
    path, files = store.root, store.storage
    if step_of(path) is not None:
        if not files.is_file(store.where(MARKER)):
            if not files.is_dir(path):
                raise FileNotFoundError(f"checkpoint path {shown(path)} is not a folder")
            raise FileNotFoundError(f"checkpoint {shown(path)} is incomplete (no {MARKER} "
                                    "marker)")
        return path
    if not files.is_dir(path):
        raise FileNotFoundError(f"checkpoint path {shown(path)} is not a folder")
    for folder in (StepFolders(store), StepFolders(Store(join(path, folder_name), files))):
        steps = folder.complete()
        if steps:
            return folder.newest_healthy(steps)
    raise FileNotFoundError(
        f"no complete checkpoint under {path} (looked for step-<N>/{MARKER} in {path} and "
        f"{join(path, folder_name)})"
    )
