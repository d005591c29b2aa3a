"""The run folder: one run per folder, and runs that don't mix.

`prepare_run_dir` runs at the start of every launch, before any data or model work:
1. rank 0 takes the folder's lock (torchllm.run.runlock): a second launch into a folder that a live
   run holds fails here; a lock left by a dead run is taken over with a warning.
2. A launch that will not resume (no complete checkpoint of its own to load, or checkpointing
   off) into a folder that holds a previous run's outputs (checkpoints or TensorBoard events)
   is refused, naming `job.run_name` and `job.overwrite`: starting at step 1 again would write a
   second set of curves over the first and leave the old checkpoints to be resumed by accident.
   `--job.overwrite` deletes those outputs, this run's checkpoint folder and its own TensorBoard
   folder and nothing else (the tokenizer cache and other runs stay), and starts afresh; the
   config keys that name these folders are checked to stay inside the dump folder
   (torchllm.config.paths: RunFolders, each folder resolved once). A checkpoint folder on
   object storage is the Checkpointer's to clear, once its steps are known to be this run's
   (checkpoint/resume/retention.py's `clear`).
   A resumed run continues the same TensorBoard curves (see torchllm.metrics.writers).
Every rank learns rank 0's outcome, so all ranks fail with the same one-line error.
The run's `config.toml` is written later (`write_run_config`), once the checkpoint loaded: a
launch that fails to resume (e.g. with a changed model shape) leaves the run's config as it was.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from torchllm.checkpoint.layout import scan_steps, step_dir, write_durably
from torchllm.config import ConfigError, paths
from torchllm.log import logger
from torchllm import ranks
from torchllm.run.runlock import RunLock, RunLockedError
from torchllm.storage import is_url


def prepare_run_dir(folders: paths.RunFolders, device: torch.device, *, stale_s: float,
                    overwrite: bool, resumes: bool, replica: bool) -> RunLock | None:
    """The run folder `folders.run`, locked by rank 0 (the lock: None on other ranks) and
    checked (see the module docstring): `stale_s` (job.lock_stale_minutes), `overwrite`
    (job.overwrite), `resumes` (checkpoint.enable: a complete checkpoint of its own is
    resumed), `replica` (fault_tolerance.enable)."""
    run_dir = folders.run
    lock, error = None, None
    if ranks.rank() == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = RunLock(run_dir, stale_s=stale_s)
            with lock.kept_on_success():  # released again when the check fails
                check_fresh_start(folders, overwrite, resumes, replica)
        except (ConfigError, OSError) as e:
            if isinstance(e, OSError):
                e = ConfigError(f"run folder {run_dir}: {e}", "job.dump_folder")
            error = e
    _agree(error, device)
    run_dir.mkdir(parents=True, exist_ok=True)
    return lock


def check_fresh_start(folders: paths.RunFolders, overwrite: bool, resumes: bool,
                      replica: bool) -> None:
    """Refuse (or, with `overwrite`, clear) a fresh start over a previous run's outputs: the
    checkpoint folder's steps (one listing) and TensorBoard events. A launch that will load one
    of this run's own complete checkpoints (`resumes`) is no fresh start."""
    ckpt, run_dir = folders.checkpoint, folders.run
    steps = scan_steps(ckpt)
    if resumes and "complete" in steps.values() and not overwrite:
        return
    found: list = [step_dir(ckpt, step) for step in sorted(steps)]
    if folders.tensorboard.is_dir():
        found += sorted(folders.tensorboard.rglob("events.out.tfevents.*"))
    if not found:
        return
    if replica and not overwrite:
        # A relaunched replica group (only the lowest live group saves, so it may have no
        # checkpoint of its own) heals from a live peer: its curves continue from that step.
        logger.warning("run folder %s holds this replica group's previous outputs: a group "
                       "behind the live ones heals from them and continues their step", run_dir)
        return
    if not overwrite:
        what = ", ".join(str(p) for p in found[:3]) + (", ..." if len(found) > 3 else "")
        resume = ("" if resumes else
                  " resume it with --checkpoint.enable (if it saved checkpoints),")
        raise ConfigError(
            f"run folder {run_dir} holds a previous run's outputs ({what}) and this launch "
            f"would start again at step 1; choose a new --job.run_name,{resume} or pass "
            "--job.overwrite to delete them and start over", "job.run_name",
        )
    delete_own_outputs(folders, found)


def delete_own_outputs(folders: paths.RunFolders, found: list[Path]) -> None:
    """Delete this run's checkpoint and TensorBoard folders, and log what went (a checkpoint
    URL's steps are the Checkpointer's to delete: Retention.clear, once they are known to be
    this run's)."""
    deleted = []
    for folder, parent in own_folders(folders):
        if not folder.is_dir():
            continue
        real, real_parent = folder.resolve(), parent.resolve()
        if real_parent not in real.parents:  # config checks make this unreachable: a symlink?
            raise ConfigError(f"job.overwrite: {folder} (really {real}) is not inside "
                              f"{real_parent}; not deleting it, remove it by hand", "job.overwrite")
        inside = [p.name for p in found if isinstance(p, Path) and folder in p.parents]
        shutil.rmtree(folder)
        deleted.append(f"{folder} ({len(inside)} item(s): {', '.join(inside[:4])}"
                       f"{', ...' if len(inside) > 4 else ''})")
    if deleted:
        logger.warning("job.overwrite: deleted run %r's previous outputs: %s", folders.run.name,
                       "; ".join(deleted))


def own_folders(folders: paths.RunFolders) -> list[tuple[Path, Path]]:
    """(folder, the folder it must lie strictly below) of what `--job.overwrite` may delete:
    this run's checkpoint folder and its own TensorBoard folder, nothing else (a checkpoint
    URL is not listed here: see delete_own_outputs)."""
    ckpt = [] if is_url(folders.checkpoint) else [(folders.checkpoint, folders.run)]
    return [*ckpt, (folders.tensorboard, folders.tensorboard_root)]


def _agree(error: Exception | None, device: torch.device) -> None:
    """Raise on every rank if rank 0 failed (same type and message), else return."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        msg = [None if error is None else (isinstance(error, RunLockedError), str(error),
                                           getattr(error, "key", None))]
        dist.broadcast_object_list(msg, src=0, device=device if device.type == "cuda" else None)
        if error is None and msg[0] is not None:
            locked, text, key = msg[0]
            raise (RunLockedError if locked else ConfigError)(text, key)
    if error is not None:
        raise error


def write_run_config(config_toml: str, run_dir: Path) -> None:
    """Rank 0: replace the run's config.toml (atomically) with this launch's effective config
    (`config_toml`: config.to_toml's text of it). Called once the checkpoint loaded, so a
    launch that cannot resume never rewrites it."""
    if ranks.rank() != 0:
        return
    path = Path(run_dir) / "config.toml"
    try:
        write_durably(path, config_toml)
    except OSError as e:  # each step folder keeps its own config.toml: not worth stopping for
        logger.warning("could not write the run's config %s: %s", path, e)
