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
   (torchllm.config.paths).
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

from torchllm.checkpoint.identity import foreign, run_id
from torchllm.checkpoint.layout import (
    complete_steps,
    delete_step,
    scan_steps,
    step_dir,
    write_durably,
)
from torchllm.config import ConfigError, JobConfig, paths, to_toml
from torchllm.log import logger
from torchllm import ranks
from torchllm.metrics.writers import tensorboard_folder
from torchllm.run.runlock import RunLock, RunLockedError
from torchllm.storage import checkpoint_folder, is_url


def run_name(cfg: JobConfig) -> str:
    """The run folder's name (checked to be one folder name when the config loads)."""
    return paths.run_name(cfg.job)


def own_folders(cfg: JobConfig, run_dir: Path) -> list[tuple[Path, Path]]:
    """(folder, the folder it must lie strictly below) of what `--job.overwrite` may delete:
    this run's checkpoint folder and its own TensorBoard folder, nothing else (a checkpoint
    URL is not listed here: its steps are deleted one by one, see delete_own_outputs)."""
    ckpt = [] if is_url(cfg.checkpoint.folder) else [(run_dir / cfg.checkpoint.folder, run_dir)]
    return [*ckpt,
            (tensorboard_folder(cfg, run_name(cfg)),
             Path(cfg.job.dump_folder) / cfg.metrics.tb_folder)]


def delete_own_outputs(cfg: JobConfig, run_dir: Path, found: list[Path]) -> None:
    """Delete this run's checkpoint and TensorBoard folders, and log what went."""
    deleted = []
    ckpt = checkpoint_folder(run_dir, cfg.checkpoint.folder)
    if is_url(ckpt):  # on an object store: this run's step prefixes, each its own only
        steps = sorted(scan_steps(ckpt))
        if problem := foreign(ckpt, complete_steps(ckpt), run_id(run_dir, ckpt)):
            raise ConfigError(f"job.overwrite: {problem}", "checkpoint.folder")
        for step in steps:
            delete_step(step_dir(ckpt, step))
        if steps:
            deleted.append(f"{ckpt} ({len(steps)} step(s): {steps})")
    for folder, parent in own_folders(cfg, run_dir):
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
    logger.warning("job.overwrite: deleted run %r's previous outputs: %s", run_name(cfg),
                   "; ".join(deleted))


def previous_outputs(cfg: JobConfig, run_dir: Path) -> list[Path]:
    """What an earlier run left that a fresh start would mix with: checkpoints, TB events."""
    found: list = []
    ckpt = checkpoint_folder(run_dir, cfg.checkpoint.folder)
    found += [step_dir(ckpt, step) for step in sorted(scan_steps(ckpt))]
    tb = tensorboard_folder(cfg, run_name(cfg))
    if tb.is_dir():
        found += sorted(tb.rglob("events.out.tfevents.*"))
    return found


def will_resume(cfg: JobConfig, run_dir: Path) -> bool:
    """Whether the checkpointer will load one of this run's own checkpoints."""
    return cfg.checkpoint.enable and bool(
        complete_steps(checkpoint_folder(run_dir, cfg.checkpoint.folder)))


def check_fresh_start(cfg: JobConfig, run_dir: Path) -> None:
    """Refuse (or, with job.overwrite, clear) a fresh start over a previous run's outputs."""
    if will_resume(cfg, run_dir) and not cfg.job.overwrite:
        return
    found = previous_outputs(cfg, run_dir)
    if not found:
        return
    if cfg.fault_tolerance.enable and not cfg.job.overwrite:
        # A relaunched replica group (only the lowest live group saves, so it may have no
        # checkpoint of its own) heals from a live peer: its curves continue from that step.
        logger.warning("run folder %s holds this replica group's previous outputs: a group "
                       "behind the live ones heals from them and continues their step", run_dir)
        return
    if not cfg.job.overwrite:
        what = ", ".join(str(p) for p in found[:3]) + (", ..." if len(found) > 3 else "")
        resume = ("" if cfg.checkpoint.enable else
                  " resume it with --checkpoint.enable (if it saved checkpoints),")
        raise ConfigError(
            f"run folder {run_dir} holds a previous run's outputs ({what}) and this launch "
            f"would start again at step 1; choose a new --job.run_name,{resume} or pass "
            "--job.overwrite to delete them and start over", "job.run_name",
        )
    delete_own_outputs(cfg, run_dir, found)


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


def prepare_run_dir(cfg: JobConfig, device: torch.device) -> tuple[Path, RunLock | None]:
    """The run folder, locked by rank 0 and checked (see the module docstring)."""
    run_dir = Path(cfg.job.dump_folder) / run_name(cfg)
    rank = ranks.rank()
    lock, error = None, None
    if rank == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = RunLock(run_dir, stale_s=60 * cfg.job.lock_stale_minutes)
            lock.acquire()
            check_fresh_start(cfg, run_dir)
        except (ConfigError, OSError) as e:
            if lock is not None and not isinstance(e, RunLockedError):
                lock.release()
            if isinstance(e, OSError):
                e = ConfigError(f"run folder {run_dir}: {e}", "job.dump_folder")
            error = e
    _agree(error, device)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, lock


def write_run_config(cfg: JobConfig, run_dir: Path) -> None:
    """Rank 0: replace the run's config.toml (atomically) with this launch's effective config.
    Called once the checkpoint loaded, so a launch that cannot resume never rewrites it."""
    if ranks.rank() != 0:
        return
    path = Path(run_dir) / "config.toml"
    try:
        write_durably(path, to_toml(cfg))
    except OSError as e:  # each step folder keeps its own config.toml: not worth stopping for
        logger.warning("could not write the run's config %s: %s", path, e)
