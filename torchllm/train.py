"""The trainer: read it top to bottom, like nanoGPT's train.py.

    ./run_train.sh [--section.key=value ...]          (torchrun -> python -m torchllm.train)
    python -m torchllm.train --help                   (every config key, by section)
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from torchllm import models
from torchllm.callbacks import StepReport, build_callbacks
from torchllm.checkpoint import Checkpointer, TrainState
from torchllm.config import ConfigError, JobConfig, help_text, load_config, to_toml
from torchllm.data import build_data, build_tokenizer
from torchllm.data.seq_len_schedule import SeqLenSchedule
from torchllm.device import resolve_device
from torchllm.eval.in_training import Evaluator
from torchllm.log import init_logger, logger
from torchllm.loss import IGNORE_INDEX
from torchllm.metrics import LossGuard, MetricsLogger, Profiler, TrainingStopped, rank
from torchllm.metrics.flops import flops_per_token, parameter_counts, peak_flops
from torchllm.optim import build_lr_scheduler, build_optimizer
from torchllm.optim.batch_ramp import BatchSizeRamp
from torchllm.parallel import (
    any_rank,
    ContextParallel,
    build_loss_fn,
    build_parallel_dims,
    clip_grad_norm_,
    destroy_distributed,
    dp_sum,
    gradient_sync,
    init_model_weights,
    rank_zero_first,
    register_float8_scale_precompute,
)


# Optional behaviour, attached to the loop through torchllm.callbacks (each class decides from
# the config whether it is on). Their events run in this order.
CALLBACKS = (Profiler, Evaluator)


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed every RNG; optionally trade speed for bit-reproducible kernels."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; it reads this at first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def use_bf16(mixed_precision: str, device: torch.device) -> bool:
    """'auto' means bf16 on CUDA only: CPUs without bf16 units run it ~100x slower than fp32."""
    if mixed_precision == "auto":
        return device.type == "cuda"
    return mixed_precision == "bf16"


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        tcfg = cfg.training
        self.device = resolve_device(tcfg.device)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        # Validate the layout before any process-group work, then build the mesh (world > 1).
        self.parallel_dims = build_parallel_dims(cfg, world_size, self.device.type,
                                                 models.model_args(cfg))
        self.parallel_dims.build_mesh(self.device)
        self.dp_degree = self.parallel_dims.dp_degree
        self.dp_rank = self.parallel_dims.dp_rank
        self.cp = ContextParallel.from_dims(self.parallel_dims)  # splits sequences (cp > 1)

        # Global batch = local batch x dp degree x accumulation steps.
        per_pass = tcfg.local_batch_size * self.dp_degree
        global_batch = per_pass if tcfg.global_batch_size == -1 else tcfg.global_batch_size
        if global_batch % per_pass:
            raise ConfigError(
                f"training.global_batch_size = {global_batch} is not a multiple of "
                f"local_batch_size ({tcfg.local_batch_size}) x data-parallel degree "
                f"({self.dp_degree}) = {per_pass}", "training.global_batch_size",
            )
        self.grad_accum_steps = global_batch // per_pass
        self.global_batch = global_batch
        # Recipes: micro-steps per step (batch-size ramp) and sequence length per step.
        self.batch_ramp = BatchSizeRamp(tcfg, per_pass, global_batch)
        self.seq_len_schedule = SeqLenSchedule(tcfg.seq_len_schedule, tcfg.seq_len, tcfg.steps)

        self.run_dir = Path(cfg.job.dump_folder) / self.run_name(cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if rank() == 0:
            (self.run_dir / "config.toml").write_text(to_toml(cfg))
        if cfg.job.print_config and rank() == 0:
            logger.info("effective config (also in %s):\n%s", self.run_dir / "config.toml",
                        to_toml(cfg))

        seed_everything(cfg.job.seed, cfg.job.deterministic)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # TF32 keeps fp32 range with a 10-bit mantissa: ~8x faster matmuls on Ampere+.
            torch.backends.cuda.matmul.allow_tf32 = tcfg.tf32
            torch.backends.cudnn.allow_tf32 = tcfg.tf32
        self.bf16 = use_bf16(tcfg.mixed_precision, self.device)

        # Tokenizer and data: the model's vocab follows the tokenizer's (padded).
        with rank_zero_first(self.parallel_dims):  # rank 0 trains and caches it, once
            self.tokenizer = build_tokenizer(cfg, self.run_dir / "data")
        self.train_loader, self.val_loader = build_data(
            cfg, self.tokenizer, self.dp_rank, self.dp_degree
        )

        # Model: built on the meta device (no memory), parallelized, then materialized.
        spec = models.get(cfg.model.name)
        self.model_args = models.model_args(cfg, self.tokenizer.vocab_size)
        self.start_time = time.perf_counter()
        with torch.device("meta"):
            self.model = spec.build(self.model_args)
        spec.parallelize_fn(self.model, self.parallel_dims, cfg)
        # Sharded or not, the initial weights equal a single CPU process's with this seed.
        init_model_weights(self.model, lambda: spec.build(self.model_args), self.device,
                           cfg.job.seed, cfg.parallelism.fsdp_cpu_offload)
        self.model.train()
        self.loss_fn = build_loss_fn(cfg.compile)

        self.optimizer = build_optimizer(self.model, cfg.optimizer, self.device)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, tcfg.steps,
                                               self.batch_ramp.lr_scale)
        register_float8_scale_precompute(self.optimizer, self.model, cfg.float8,
                                         self.parallel_dims.fsdp_enabled)

        counts = parameter_counts(self.model)
        self.flops_per_token = flops_per_token(self.model, tcfg.seq_len)
        self.peak_flops = peak_flops(self.device)
        logger.info(
            "model %s/%s: %s params (%s non-embedding), vocab %d (tokenizer %d) | device %s, "
            "%s | global batch %d seqs x %d tokens = %d local x %d dp x %d accumulation",
            cfg.model.name, cfg.model.flavor, f"{counts['params']:,}",
            f"{counts['non_embedding_params']:,}", self.model_args.vocab_size,
            self.tokenizer.vocab_size, self.device, self.precision_name(),
            global_batch, tcfg.seq_len, tcfg.local_batch_size, self.dp_degree,
            self.grad_accum_steps,
        )
        # Everything a resumed run needs lives in the checkpoint: weights, optimizer, schedule,
        # data position, counters and RNG states.
        self.train_state = TrainState()
        self.guard = LossGuard(cfg.metrics)
        # Profiler, validation, samples, HellaSwag, ...: each on its own schedule.
        self.callbacks = build_callbacks(CALLBACKS, self)
        stateful = {cb.checkpoint_key: cb for cb in self.callbacks if cb.checkpoint_key}
        self.checkpointer = Checkpointer(
            cfg.checkpoint, self.run_dir, self.model, self.optimizer, self.lr_scheduler,
            dataloader=self.train_loader, train_state=self.train_state, dp_rank=self.dp_rank,
            device=self.device, others={"loss_guard": self.guard, **stateful},
        )
        # A guard that stops the run saves first (when checkpointing is on) for inspection.
        self.guard.save_checkpoint = self.checkpointer.save
        self.metrics = MetricsLogger(
            cfg, self.model, self.optimizer, self.device, self.run_name(cfg), self.run_dir,
            self.flops_per_token, self.peak_flops, self.guard, group=self.parallel_dims.dp_group,
        )
        if cfg.checkpoint.enable or cfg.checkpoint.initial_load_path:
            self.checkpointer.load()
        # Created after loading: the iterator starts where the restored loader state points.
        self.batches = iter(self.train_loader)
        self.stop_signal: int | None = None

    def callback(self, cls):
        """The attached callback of class `cls` (e.g. trainer.callback(Evaluator)), or None."""
        return next((cb for cb in self.callbacks if isinstance(cb, cls)), None)

    @property
    def evaluator(self) -> Evaluator | None:
        return self.callback(Evaluator)

    @property
    def profiler(self) -> Profiler | None:
        return self.callback(Profiler)

    @property
    def step(self) -> int:
        return self.train_state.step

    @staticmethod
    def run_name(cfg: JobConfig) -> str:
        if cfg.job.run_name:
            return cfg.job.run_name
        return Path(cfg.job.config_file).stem if cfg.job.config_file else "default"

    def precision_name(self) -> str:
        if not self.bf16:
            return "fp32"
        return "bf16 FSDP2 params" if self.parallel_dims.fsdp_enabled else "bf16 autocast"

    def autocast(self):
        # Under FSDP2, MixedPrecisionPolicy(param_dtype=bf16) already runs the matmuls in bf16
        # (and keeps fp32 master weights), so autocast would only add casts.
        if not self.bf16 or self.parallel_dims.fsdp_enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def forward_backward(self, micro_batches) -> tuple[torch.Tensor, int]:
        """Accumulate the gradient of the global batch's mean token loss; returns (sum, tokens)."""
        # Normalize by the token count of the whole global batch, so that the step's loss is
        # the mean over all its tokens however it is split into micro-batches.
        n_tokens = sum(int((b["targets"] != IGNORE_INDEX).sum()) for b in micro_batches)
        (global_tokens,) = dp_sum([n_tokens], self.parallel_dims, self.device)
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            inputs = batch["inputs"].to(self.device, non_blocking=True)
            targets = batch["targets"].to(self.device, non_blocking=True)
            positions = batch.get("positions")
            positions = None if positions is None else positions.to(self.device, non_blocking=True)
            # Where tokens sit in their documents (block_causal masks, per-document positions);
            # under context parallelism, this rank's share of the tokens.
            inputs, targets, layout = self.cp.shard(inputs, targets, positions)
            # Gradients are reduced across dp ranks on the last micro-step only.
            with gradient_sync(self.model, enabled=i == len(micro_batches) - 1):
                if self.cfg.training.chunked_loss:  # the model returns the summed loss
                    with self.autocast():
                        loss = self.model(inputs, targets=targets, layout=layout,
                                          loss_chunk_tokens=self.cfg.training.loss_chunk_tokens)
                else:
                    with self.autocast():
                        logits = self.model(inputs, layout=layout)
                    loss = self.loss_fn(logits, targets)  # float32, outside autocast
                    del logits
                # Data-parallel gradient averaging divides by dp_degree; undo it so the
                # gradient is exactly that of the global mean.
                # (FSDP2 also averages over the cp ranks, each holding part of the tokens.)
                (loss * (self.dp_degree * self.cp.degree / global_tokens)).backward()
            loss_sum += loss.detach()
            del loss
        return self.cp.reduce_loss(loss_sum), n_tokens

    def train_step(self) -> dict[str, float]:
        """One optimizer step over grad_accum_steps micro-batches; returns its metrics."""
        t0 = time.perf_counter()
        micro_batches = [self.seq_len_schedule.cut(next(self.batches), self.step)
                         for _ in range(self.batch_ramp.accum_steps(self.step))]
        data_time = time.perf_counter() - t0
        loss_sum, n_tokens = self.forward_backward(micro_batches)
        m = self.metrics.loss_stats(self.step, loss_sum, n_tokens)  # reduced over dp ranks
        m.update(self.metrics.before_clip(self.step))

        max_norm = self.cfg.training.max_norm
        grad_norm = clip_grad_norm_(self.model.parameters(), max_norm)  # DTensor-aware
        m.update(grad_norm=grad_norm.item(), lr=self.optimizer.param_groups[0]["lr"],
                 data_time=data_time)
        # The guard may drop this update (the LR schedule still advances) or stop the run.
        m["skipped"] = not self.guard.check(self.step, m["loss"], m["grad_norm"])
        if not m["skipped"]:
            self.checkpointer.wait_for_staging()  # an async save must copy the weights first
            with self.metrics.around_update(self.step, m):
                self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return m

    def _on_signal(self, signum, frame) -> None:
        """Preemption (SIGTERM) or Ctrl-C: finish the current step, save, exit 0."""
        if self.stop_signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.stop_signal = signum
        logger.warning("received %s: stopping after this step", signal.Signals(signum).name)

    def stop_reason(self, steps_this_launch: int, slowest_step: float) -> str | None:
        """Why this launch should stop early (signal, step budget, time limit), if it should.

        Ranks see signals and clocks at slightly different moments; they agree (any rank
        stopping stops all) so that every rank saves the same step and none waits forever.
        """
        tcfg = self.cfg.training
        reason = None
        if self.stop_signal is not None:
            reason = f"signal {signal.Signals(self.stop_signal).name}"
        elif tcfg.stop_after_steps and steps_this_launch >= tcfg.stop_after_steps:
            reason = f"training.stop_after_steps = {tcfg.stop_after_steps} reached"
        elif tcfg.time_limit_minutes:
            # Leave room for two more slow steps and the final save before the limit.
            elapsed = time.perf_counter() - self.start_time
            if elapsed + 2 * slowest_step + 60 > 60 * tcfg.time_limit_minutes:
                reason = f"training.time_limit_minutes = {tcfg.time_limit_minutes} nearly reached"
        if any_rank(reason is not None, self.device) and reason is None:
            reason = "another rank is stopping"
        return reason

    def train(self) -> list[float]:
        """Run up to training.steps optimizer steps; returns the loss of every step run here."""
        tcfg = self.cfg.training
        if self.cfg.checkpoint.create_seed_checkpoint:
            self.checkpointer.save(0, model_only=True)
            logger.info("seed checkpoint written; exiting")
            return []
        losses: list[float] = []
        slowest_step = 0.0
        tokens_before = self.train_state.tokens_seen
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        # Automatic GC pauses at random moments cost whole steps; collect on our schedule.
        gc.disable()
        for cb in self.callbacks:
            cb.on_train_start(self)
        start = time.perf_counter()
        try:
            while self.step < tcfg.steps:
                self.train_state.step += 1
                if self.step % tcfg.gc_freq == 0:
                    gc.collect(1)
                t0 = time.perf_counter()
                m = self.train_step()
                step_time = time.perf_counter() - t0
                slowest_step = max(slowest_step, step_time)
                self.train_state.tokens_seen += m["tokens"]
                losses.append(m["loss"])
                self.metrics.log(self.step, m, step_time)
                report = StepReport()
                for cb in self.callbacks:
                    report.update(cb.on_step_end(self, self.step, m))
                self.metrics.log_eval(self.step, report.scalars, report.texts)

                self.checkpointer.poll()
                last = self.step == tcfg.steps
                reason = None if last else self.stop_reason(len(losses), slowest_step)
                if reason or self.checkpointer.should_save(self.step, last=last):
                    self.checkpointer.save(self.step, last=last)
                if reason:
                    logger.warning("stopping at step %d: %s", self.step, reason)
                    break
        except BaseException as e:
            for cb in self.callbacks:
                cb.on_exception(self, self.step, e)
            raise
        finally:
            gc.enable()
            for s, handler in previous.items():
                signal.signal(s, handler)
            for cb in self.callbacks:
                cb.on_train_end(self)
            self.metrics.close()
            self.checkpointer.close()
        if losses:
            elapsed = time.perf_counter() - start
            tokens = self.train_state.tokens_seen - tokens_before
            logger.info(
                "done: step %d/%d, %d steps in %.1fs, %s tokens (%.0f tok/s); "
                "loss %.4f -> %.4f (min %.4f)",
                self.step, tcfg.steps, len(losses), elapsed, f"{tokens:,}", tokens / elapsed,
                losses[0], losses[-1], min(losses),
            )
        return losses


def trainer_from_args(argv: list[str]) -> Trainer | None:
    """A Trainer from CLI overrides, or None after logging a config error (exit code 2)."""
    try:
        return Trainer(load_config(argv))
    except ConfigError as e:
        logger.error("config error: %s", e)
        destroy_distributed()
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    init_logger()
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    trainer = trainer_from_args(argv)
    if trainer is None:
        return 2
    try:
        trainer.train()
    except TrainingStopped as e:
        logger.error("training stopped by the guard: %s", e)
        return 3
    except KeyboardInterrupt:
        logger.warning("interrupted at step %d; stopping", trainer.step)
        return 130
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
