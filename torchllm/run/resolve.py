"""The run, resolved once before the Trainer is built: its config (a stage's tokenizer made
concrete), device and process layout, folder (and its lock), precision and tokenizer.

Each is decided here, in this order, and nowhere else: the Trainer (torchllm.train) takes a `Run`
and builds the model, data, optimizer and checkpointer from it without deciding any of them
again (the model is built in `run.bf16`, not re-resolved from training.mixed_precision = "auto";
the data gets `run.tokenizer`; the checkpointer records `run.tokenizer_record`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from torchllm import models
from torchllm.checkpoint import recorded_precision
from torchllm.checkpoint.stage.tokenizer_identity import tokenizer_record
from torchllm.config import JobConfig, to_toml
from torchllm.config.paths import run_folders
from torchllm.data import Tokenizer, tokenizer_of
from torchllm.data.dataset import parse_data
from torchllm.device import resolve_device
from torchllm.ft import replica_job
from torchllm.log import logger, open_run_log
from torchllm.parallel import ParallelDims, build_parallel_dims, rank_zero_first
from torchllm.precision import resolve_bf16
from torchllm.ranks import env_world_size, rank
from torchllm.run.rundir import prepare_run_dir
from torchllm.run.runlock import RunLock
from torchllm.run.tokenizer import stage_tokenizer, trains_new_tokenizer


@dataclasses.dataclass
class Run:
    cfg: JobConfig  # as given, but a stage's data.tokenizer is the initial load's (concrete)
    device: torch.device
    parallel_dims: ParallelDims  # the mesh built (process group up when world > 1)
    folder: Path  # RUN: checkpoints, logs, config.toml
    lock: RunLock | None  # held until the Trainer closes (one run per folder)
    bf16: bool  # the precision the model trains in ("auto" decided, or kept from a resume)
    tokenizer: Tokenizer
    tokenizer_record: dict  # what the checkpoints record of it (checkpoint/stage/tokenizer_identity.py)

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp32"


def resolve_run(cfg: JobConfig) -> Run:
    """Everything about this launch that is decided once, on every rank alike (ConfigError for a
    config that cannot run). On failure after taking the run folder's lock, the lock is freed."""
    # data.tokenizer = "from_initial_load": the previous stage's, made concrete first, so that
    # the config.toml this run writes names it for generate, evals and the next stage.
    cfg = dataclasses.replace(cfg, data=stage_tokenizer(cfg.data, cfg.checkpoint,
                                                        log=rank() == 0))
    cfg = dataclasses.replace(cfg, job=replica_job(cfg.job, cfg.fault_tolerance))  # fault tolerance: each replica group has its own run folder
    tcfg = cfg.training
    device = resolve_device(tcfg.device)
    # Validate the layout before any process-group work, then build the mesh (world > 1).
    parallel_dims = build_parallel_dims(
        env_world_size(), device.type, models.model_args(cfg.model, tcfg, cfg.data),
        parallelism=cfg.parallelism, model=cfg.model, training=tcfg, data=cfg.data,
        eval=cfg.eval, float8=cfg.float8, activation_checkpoint=cfg.activation_checkpoint,
        lora=cfg.lora, compile=cfg.compile)
    parallel_dims.build_mesh(device, cfg.comm.init_timeout_seconds)
    # One run per folder (a lock), and no fresh start over a previous run's outputs.
    folders = run_folders(cfg.job, cfg.checkpoint, cfg.metrics)
    folder = folders.run
    lock = prepare_run_dir(folders, device, stale_s=60 * cfg.job.lock_stale_minutes,
                           overwrite=cfg.job.overwrite, resumes=cfg.checkpoint.enable,
                           replica=cfg.fault_tolerance.enable)
    try:
        open_run_log(folder, rank())  # RUN/train.log (under torchllm.train's main)
        # bf16 where this hardware runs it natively (see torchllm.precision); fp32 otherwise. A
        # resumed run keeps the precision its checkpoint recorded ("auto" is a timed probe);
        # --job.overwrite resumes nothing (a checkpoint URL's steps go with the Checkpointer).
        resumes = cfg.checkpoint.enable and not cfg.job.overwrite
        recorded = (recorded_precision(folders.checkpoint, cfg.checkpoint.load_step, device)
                    if resumes else None)
        bf16, why = resolve_bf16(tcfg.mixed_precision, device.type, recorded)
        precision = "bf16" if bf16 else "fp32"
        (logger.info if recorded in (None, precision) else logger.warning)(
            "precision: %s (%s)", precision, why)
        parallel_dims.bf16 = bf16  # FSDP2's param dtype: this, not "auto" again
        if cfg.job.print_config and rank() == 0:  # the console gets a short header (Trainer)
            logger.info("effective config:\n%s", to_toml(cfg))
        # The model's vocab follows the tokenizer's (padded), decided from the data config
        # parsed once: data.tokenizer, or for 'auto' the data's own (shards) or one trained on it.
        data = parse_data(cfg.data)
        with rank_zero_first(parallel_dims):  # rank 0 trains and caches it, once
            tokenizer = tokenizer_of(data, folder / "data")
        record = tokenizer_record(tokenizer, new=trains_new_tokenizer(cfg.data, cfg.checkpoint))
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Run(cfg, device, parallel_dims, folder, lock, bf16, tokenizer, record)

