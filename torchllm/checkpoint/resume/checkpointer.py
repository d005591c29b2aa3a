"""Sharded, resumable, optionally asynchronous checkpoints with torch.distributed.checkpoint.

A Checkpointer is composed of parts, each its own file: the states it saves
(checkpoint/state.py), the saver (saver.py: sync, async and mirrored saves, committed by the
COMPLETE marker), retention (retention.py: the known steps, keep_latest_k), and the loader
(loading.py: which step; restore.py: one step, opened once as a checkpoint/step.Step, fit by
the checks features register (fit.py), read and applied). Every
decision that ranks could see differently (which checkpoint loads, whether a save failed or
finished) is agreed over a small gloo group (agree.py), so ranks never hang or diverge.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torchllm.checkpoint.resume.agree import RankAgreement
from torchllm.checkpoint.identity import run_id
from torchllm.checkpoint.integrity import free_bytes, human, state_estimate
from torchllm.checkpoint.resume.loading import Resume
from torchllm.checkpoint.resume.mirror import Mirror
from torchllm.checkpoint.resume.restore import Restore
from torchllm.checkpoint.resume.hparams import hparams_snapshot
from torchllm.checkpoint.resume.retention import Retention
from torchllm.checkpoint.resume.saver import CheckpointSaveError, Saver
from torchllm.checkpoint.training_state import TrainingState
from torchllm.config.job_config import ConfigError
from torchllm.config.paths import checkpoint_folder
from torchllm.log import logger
from torchllm.storage import is_url, set_store_timeout

LOADABLE = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")


class Checkpointer:
    """Saves and restores the run's one training state (training_state.py): model, optimizer,
    scheduler, data position, counters, the loop's and features' objects, RNGs."""

    def __init__(
        self,
        ccfg,
        run_dir: Path,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        dataloader: Any = None,
        train_state: Any = None,
        dp_rank: int = 0,
        device: torch.device = torch.device("cpu"),
        others: dict[str, Any] | None = None,
        run_info: dict[str, Any] | None = None,
        load_hf=None,
        fresh: bool = False,
        state: TrainingState | None = None,
    ):
        """`state`: the run's one training state (training_state.py: the list a heal copies
        too; the trainer's); without it, the state of `model`, `optimizer`, `lr_scheduler`,
        `dataloader`, `train_state` and `others` (more objects with state_dict()/
        load_state_dict(), saved under their keys) and the RNG states. `run_info`:
        `config_toml` (written into each step folder, compared at resume) and
        `global_batch_size` (must not change silently). `load_hf(model, folder,
        tokenizer_record)`: what loads a Hugging Face folder for
        checkpoint.initial_load_in_hf (torchllm.hf.load_initial_weights). `fresh`
        (job.overwrite): the steps of a checkpoint URL are deleted first (Retention.clear; a
        local checkpoint folder was deleted with the run folder's outputs, run/rundir.py)."""
        self.cfg = ccfg
        self.enabled = ccfg.enable or ccfg.create_seed_checkpoint
        self.folder = checkpoint_folder(run_dir, ccfg.folder)  # a local path or a URL
        set_store_timeout(ccfg.store_timeout_s)
        # Agreement between ranks on CPU tensors: no device sync, never mixed with training's.
        self.agree = RankAgreement.of_this_job()
        # This run's id (identity.py), recorded in every step it saves (rank 0 writes markers);
        # a folder whose steps another run wrote is never resumed, written into or pruned.
        run_info = dict(run_info or {})
        fresh = fresh and is_url(self.folder)
        if self.enabled or ccfg.initial_load_path or fresh:  # (a load tries the folder first)
            run_info["run_id"] = self.agree.first_answer(
                run_id(Path(run_dir), self.folder) if self.agree.rank == 0 else None)
        self.retention = Retention(self.folder, ccfg.keep_latest_k, self.agree,
                                   run_info.get("run_id"))
        if fresh:
            self.retention.clear()
        if state is None:
            state = TrainingState.of(model, optimizer, lr_scheduler, dataloader, train_state,
                                     others)
        self.state = state
        model, optimizer, lr_scheduler = (state.get(k) for k in ("model", "optimizer",
                                                                  "lr_scheduler"))
        self.loadable = [*LOADABLE, *(name for name in state.names() if name not in LOADABLE)]
        bad = set(ccfg.exclude_from_loading) - set(self.loadable)
        if bad:
            raise ConfigError(
                f"checkpoint.exclude_from_loading has unknown entries {sorted(bad)}; allowed: "
                f"{', '.join(self.loadable)}", "checkpoint.exclude_from_loading",
            )
        # Per-rank pieces get per-rank keys: DCP keeps one copy of identically named values.
        self.states: dict[str, Any] = state.saved_states(dp_rank, self.agree.rank)
        keys = {p.name: state.key(p, dp_rank, self.agree.rank) for p in state.pieces.values()}
        dataloader_key, rng_key = keys.get("dataloader"), keys.get("rng")

        # The configured hyperparameters, before a load replaces them with the checkpoint's.
        hparams = hparams_snapshot(optimizer) if optimizer is not None else None
        restore = Restore(ccfg, self.states, dataloader_key, rng_key, self.agree, optimizer,
                             lr_scheduler, hparams, run_info)
        self.resume = Resume(ccfg, restore, self.retention, model, self.loadable,
                             optimizer is not None, load_hf)
        # Steps written locally first, uploaded in the background (object storage only).
        mirror = Mirror(Path(run_dir) / ccfg.local_mirror, self.agree.rank) \
            if self.enabled and ccfg.local_mirror else None
        self.saver = Saver(ccfg, self.states, model, self.retention, self.agree, device, mirror,
                           run_info)
        if self.enabled and ccfg.async_mode != "disabled":
            self.saver.setup_async(ccfg.async_mode, device)
        if ccfg.enable and not ccfg.create_seed_checkpoint:
            self._check_room(model, optimizer)

    def _check_room(self, model: torch.nn.Module, optimizer) -> None:
        """Before step 1: the disk must hold one save (model + the optimizer state's estimate;
        AdamW's moments do not exist until its first step), or the launch is refused in one line
        instead of training until its first save fails."""
        needed = sum(self.agree.gather(state_estimate(model, optimizer)))
        free = free_bytes(self.folder)
        if self.agree.all(free is None or free >= needed):
            return
        raise CheckpointSaveError(
            f"no space left on {self.folder} for one checkpoint: it needs about {human(needed)} "
            f"(model + optimizer state), {human(free or 0)} free; free space or set "
            "checkpoint.folder to a disk with room")

    @property
    def steps(self) -> list[int] | None:
        """The complete steps this Checkpointer knows, oldest first (None before it listed)."""
        return self.retention.steps

    @property
    def pending(self) -> dict | None:
        """The background save in flight ({"step": ...}), or None."""
        return self.saver.pending

    def load(self) -> int | None:
        """Restore the newest loadable checkpoint of this run (or `initial_load_path`): the
        step restored from this run's folder, 0 for initial weights, None for a fresh start
        (loading.Resume.pick: which step, else Resume.start; restore.Restore.restore: open,
        fit, read, apply)."""
        step = self.resume.pick()
        return step if step is not None else self.resume.start()

    def should_save(self, step: int, last: bool = False) -> bool:
        return self.enabled and (last or step % self.cfg.interval == 0)

    def save(self, step: int, last: bool = False, model_only: bool = False,
             unhealthy: str | None = None) -> None:
        """Save `step` (blocking only for staging when async). Every rank calls it.

        `last` applies the export options (last_save_model_only, export_dtype); `model_only`
        saves just the float32 weights (seed checkpoints). `unhealthy`: why this step must not
        be resumed from (the loss guard skipping updates; recorded in the marker). A failed save
        raises CheckpointSaveError (or, with on_save_error = 'continue', logs it and returns).
        """
        if self.enabled:
            self.saver.save(step, last, model_only, unhealthy)

    def wait_for_staging(self) -> None:
        """Block until a background save has copied the state; call before weights change."""
        self.saver.wait_for_staging()

    def poll(self) -> None:
        """Finish a background save once every rank's part is written (call once per step on
        every rank)."""
        self.saver.poll()

    def wait(self) -> None:
        """Block until the pending background save is written and committed (every rank)."""
        self.saver.wait()

    def close(self) -> None:
        """Finish a pending save (see Saver.close: also while an exception unwinds)."""
        self.saver.close()

    def explain_resume(self, step: int) -> None:
        """One line, after the loss guard stopped at `step` (saved, unhealthy): which step a
        relaunch resumes from."""
        if not self.enabled:
            return
        good = self.retention.newest_good()
        if good is not None:
            logger.warning("resume will continue from step-%d, the last checkpoint saved before "
                           "updates were skipped (step-%d and any saved while skipping are kept "
                           "for inspection, never resumed from)", good, step)
        else:
            logger.warning("no checkpoint was saved before updates were skipped: a relaunch "
                           "resumes from step-%d as it is (checkpoint.load_step picks another, "
                           "--job.overwrite starts over)", step)
