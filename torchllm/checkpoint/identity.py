"""The identity record of a step: whose it is and what it was trained on, written at save (JSON
fields of the COMPLETE marker) and checked by every reader that could mix two runs.

    run_id      the run that wrote the step: a random id kept in the run folder's `run_id`
                file, made at its first launch with checkpointing and kept by every relaunch
    data        what the data position means (torchllm.data.fingerprint: sources, weights and
                each source's own content identity, seq_len, seed; restore.py compares it)
    tokenizer   the run's tokenizer with its file's SHA-256 (stage/tokenizer_identity.py
                compares it)

A run never resumes from, writes into or prunes another run's steps: a checkpoint folder is
this run's when every complete step in it records this run's id (or none: written before run
ids). `foreign` says why not, in one line naming the folder, the other run and what to do; the
Checkpointer refuses such a folder before it loads, deletes or saves anything (resume/retention.py's
listing and `clear`, and loading.py's scan, all ask), so `--job.overwrite` deletes no other run's
steps. A run folder that has no id yet takes the one its own checkpoint folder's steps record (a
run folder copied without its id file); a checkpoint URL proves nothing about the run folder
that names it, so there an id is never taken.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from torchllm.checkpoint.layout import StepFolders, as_folders
from torchllm.checkpoint.step import MarkerError, read_marker
from torchllm.log import logger
from torchllm.storage import Location, is_url

RUN_ID_FILE = "run_id"


def owner(folder: Location | StepFolders, step: int) -> str | None:
    """The run id a complete step records (None: none recorded, or an unreadable marker, which
    the load itself reports)."""
    try:
        return read_marker(as_folders(folder).step_store(step)).get("run_id")
    except MarkerError:
        return None


def run_id(run_dir: Path, folder: Location) -> str:
    """This run's id (rank 0): read from the run folder, else taken from its own checkpoint
    folder's newest step that records one (a local folder inside the run folder only), else
    new; written into the run folder so that every relaunch keeps it."""
    path = Path(run_dir) / RUN_ID_FILE
    if path.is_file():
        found = path.read_text().strip()
        if found:
            return found
    found = None
    if not is_url(folder) and Path(run_dir).resolve() in Path(folder).resolve().parents:
        folders = StepFolders(folder)
        found = next((o for s in reversed(folders.complete()) if (o := owner(folders, s))),
                     None)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    path.write_text((found or uuid.uuid4().hex) + "\n")
    if found:
        logger.info("run folder %s had no %s: it takes %s, the id its checkpoints record",
                    run_dir, RUN_ID_FILE, found)
    return path.read_text().strip()


def foreign(folder: Location | StepFolders, steps: list[int], mine: str | None) -> str | None:
    """Why `folder` (whose complete steps are `steps`) is not this run's to resume from, write
    into or prune: one line naming the folder, the other run and what to do; None when it is."""
    if mine is None:
        return None
    folder = as_folders(folder)
    for step in reversed(steps):
        other = owner(folder, step)
        if other is not None and other != mine:
            path = folder.step_path(step)
            return (f"checkpoint.folder {folder} holds another run's checkpoints ({path} was "
                    f"written by run {other}; this run is {mine}): a run never resumes from, "
                    "writes into or prunes another run's steps. To start from its weights, set "
                    f"checkpoint.initial_load_path = {path} and give this run a checkpoint.folder "
                    "of its own; to continue that run, launch it from its own run folder")
    return None
