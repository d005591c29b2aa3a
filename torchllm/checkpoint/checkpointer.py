"""Sharded, resumable, optionally asynchronous checkpoints with torch.distributed.checkpoint.

Every rank writes its own shards of one DCP directory per step. A save becomes visible to
loading and retention only when rank 0 writes the COMPLETE marker after every rank finished,
so a crash mid-save never damages what was already on disk.
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from torchllm.checkpoint.layout import complete_steps, mark_complete, resolve_checkpoint, step_dir
from torchllm.checkpoint.state import ModelState, OptimizerState, PickledState, RNGState
from torchllm.config.job_config import ConfigError
from torchllm.log import logger

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOADABLE = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def saved_keys(path: Path) -> set[str]:
    """Top-level keys of a DCP checkpoint (reads only its metadata file)."""
    metadata = FileSystemReader(str(path)).read_metadata()
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


class Checkpointer:
    """Saves and restores model, optimizer, scheduler, data position, counters and RNGs."""

    def __init__(
        self,
        ccfg,
        run_dir: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        dataloader: Any = None,
        train_state: Any = None,
        dp_rank: int = 0,
        device: torch.device = torch.device("cpu"),
        others: dict[str, Any] | None = None,
    ):
        """`others`: more objects with state_dict()/load_state_dict(), saved under their keys
        (identical on every rank, like the train state)."""
        self.cfg = ccfg
        self.enabled = ccfg.enable or ccfg.create_seed_checkpoint
        self.folder = Path(run_dir) / ccfg.folder
        self.model, self.optimizer = model, optimizer
        self.rank = _rank()
        others = others or {}
        self.loadable = [*LOADABLE, *others]
        bad = set(ccfg.exclude_from_loading) - set(self.loadable)
        if bad:
            raise ConfigError(
                f"checkpoint.exclude_from_loading has unknown entries {sorted(bad)}; allowed: "
                f"{', '.join(self.loadable)}", "checkpoint.exclude_from_loading",
            )
        # Per-rank objects get per-rank keys: DCP keeps one copy of identically named values.
        self.dataloader_key = f"dataloader_dp{dp_rank}"
        self.rng_key = f"rng_rank{self.rank}"
        self.states: dict[str, Any] = {"model": ModelState(model)}
        if optimizer is not None:
            self.states["optimizer"] = OptimizerState(model, optimizer)
        if lr_scheduler is not None:
            self.states["lr_scheduler"] = PickledState(lr_scheduler)
        if dataloader is not None:
            self.states[self.dataloader_key] = PickledState(dataloader)
        if train_state is not None:
            self.states["train_state"] = PickledState(train_state)
        for key, obj in others.items():
            self.states[key] = PickledState(obj)
        self.states[self.rng_key] = RNGState()

        self.pending: tuple[int, Future] | None = None
        self.staging: Future | None = None
        self.stager = None
        self.async_group = None
        if self.enabled and ccfg.async_mode != "disabled":
            self._setup_async(ccfg.async_mode, device)

    def _setup_async(self, mode: str, device: torch.device) -> None:
        """Stage (copy to host memory) in a background thread, then write in another.

        Weights change only in optimizer.step(), so staging overlaps the next step's forward
        and backward; the trainer calls wait_for_staging() before stepping the optimizer.
        """
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if mode == "async_with_pinned_mem":
            if device.type != "cuda":
                raise ConfigError(
                    "checkpoint.async_mode = 'async_with_pinned_mem' stages through pinned host "
                    "memory and needs CUDA; on CPU use 'async'", "checkpoint.async_mode",
                )
            options = StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                     use_async_staging=True, use_non_blocking_copy=True)
        else:
            options = StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                     use_async_staging=True, use_non_blocking_copy=False)
        self.stager = DefaultStager(options)
        if dist.is_initialized():
            # Background saves talk on their own gloo group, never interleaving with training's.
            self.async_group = dist.new_group(backend="gloo")

    # ---------------------------------------------------------------- saving

    def should_save(self, step: int, last: bool = False) -> bool:
        return self.enabled and (last or step % self.cfg.interval == 0)

    def save(self, step: int, last: bool = False, model_only: bool = False) -> None:
        """Save `step` (blocking only for staging when async).

        `last` applies the export options (last_save_model_only, export_dtype); `model_only`
        saves just the float32 weights (seed checkpoints).
        """
        if not self.enabled:
            return
        self.wait()
        path = step_dir(self.folder, step)
        if self.rank == 0 and path.exists():
            shutil.rmtree(path)  # a crashed or stale save of this step; complete ones are rewritten
        _barrier()
        export = last and self.cfg.last_save_model_only
        model_only = model_only or export
        if model_only:
            dtype = EXPORT_DTYPES[self.cfg.export_dtype] if export else torch.float32
            state = {"model": ModelState(self.model, None if dtype == torch.float32 else dtype)}
        else:
            state = self.states
        t0 = time.perf_counter()
        if self.cfg.async_mode == "disabled" or model_only:
            dcp.save(state, checkpoint_id=str(path))
            self._finish(step)
            logger.info("saved checkpoint %s in %.2fs%s", path, time.perf_counter() - t0,
                        " (model only)" if model_only else "")
            return
        response = dcp.async_save(
            state, checkpoint_id=str(path), process_group=self.async_group,
            async_stager=self.stager,
        )
        self.staging = response.staging_completion
        self.pending = (step, response.upload_completion)
        logger.info("checkpoint %s: staging and writing in the background (blocked %.2fs)",
                    path, time.perf_counter() - t0)

    def wait_for_staging(self) -> None:
        """Block until a background save has copied the state; call before weights change."""
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def poll(self) -> None:
        """Finish a background save that has completed (cheap; call once per step)."""
        if self.pending is not None and self.pending[1].done():
            self.wait()

    def wait(self) -> None:
        """Block until the pending background save is written; re-raise its error if it failed."""
        if self.pending is None:
            return
        step, future = self.pending
        self.pending = None
        self.wait_for_staging()
        future.result()
        self._finish(step)
        logger.info("checkpoint step-%d written", step)

    def _finish(self, step: int) -> None:
        """All ranks' shards are on disk (DCP's final all-reduce): commit, then apply retention."""
        if self.rank == 0:
            mark_complete(step_dir(self.folder, step), step)
            self._purge()

    def _purge(self) -> None:
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        for old in complete_steps(self.folder)[:-k]:
            shutil.rmtree(step_dir(self.folder, old), ignore_errors=True)

    def close(self) -> None:
        self.wait()
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    # --------------------------------------------------------------- loading

    def load(self) -> int | None:
        """Restore the newest loadable checkpoint of this run (or `initial_load_path`).

        Returns the step restored from this run's folder, 0 for initial weights, None for a
        fresh start. A checkpoint that fails to load is skipped with a warning for the one
        before it; if a specific `load_step` was asked for, its failure is an error.
        """
        steps = complete_steps(self.folder, warn_incomplete=True)
        if self.cfg.load_step != -1:
            if self.cfg.load_step not in steps:
                raise ConfigError(
                    f"checkpoint.load_step = {self.cfg.load_step}: no complete checkpoint at that "
                    f"step in {self.folder}; available: {steps or 'none'}", "checkpoint.load_step",
                )
            self._load_from(step_dir(self.folder, self.cfg.load_step), self.cfg.exclude_from_loading)
            return self.cfg.load_step
        for step in reversed(steps):
            path = step_dir(self.folder, step)
            try:
                self._load_from(path, self.cfg.exclude_from_loading)
            except ConfigError:
                raise
            # DCP wraps every rank's read error in CheckpointException (a BaseException).
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - unreadable: fall back
                logger.warning("checkpoint %s could not be loaded (%s: %s); trying an earlier one",
                               path, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                continue
            logger.info("resumed from %s", path)
            return step
        if steps:
            raise RuntimeError(f"none of the checkpoints {steps} in {self.folder} could be loaded")
        if self.cfg.initial_load_path and self.cfg.initial_load_in_hf:
            from torchllm.checkpoint.hf import load_hf_weights

            load_hf_weights(self.model, self.cfg.initial_load_path)
            logger.info("initialized from Hugging Face weights %s", self.cfg.initial_load_path)
            return 0
        if self.cfg.initial_load_path:
            path = resolve_checkpoint(self.cfg.initial_load_path)
            model_only = self.cfg.initial_load_model_only
            exclude = [k for k in self.loadable if k != "model"] if model_only else []
            self._load_from(path, exclude)
            logger.info("initialized from %s%s", path,
                        " (model only)" if self.cfg.initial_load_model_only else "")
            return 0
        return None

    def _load_from(self, path: Path, exclude: list[str]) -> None:
        present = saved_keys(path)
        wanted = {}
        for key, state in self.states.items():
            kind = "dataloader" if key == self.dataloader_key else "rng" if key == self.rng_key else key
            if kind in exclude:
                continue
            if key in present:
                wanted[key] = state
            elif kind == "model":
                raise ConfigError(f"checkpoint {path} holds no model weights")
            elif kind == "dataloader" and any(k.startswith("dataloader_dp") for k in present):
                saved = sorted(k for k in present if k.startswith("dataloader_dp"))
                raise ConfigError(
                    f"checkpoint {path} holds the data-loader positions of {len(saved)} "
                    f"data-parallel ranks ({', '.join(saved)}), not of this rank's "
                    f"{self.dataloader_key}: resuming with another data-parallel degree cannot "
                    "continue the same data order; add 'dataloader' to "
                    "checkpoint.exclude_from_loading to restart the data order instead",
                    "checkpoint.exclude_from_loading",
                )
            elif kind != "rng":
                logger.warning("checkpoint %s has no %s state; it starts fresh", path, kind)
        dcp.load(wanted, checkpoint_id=str(path))
