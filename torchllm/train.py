"""The trainer: read it top to bottom, like nanoGPT's train.py.

    ./run_train.sh [--section.key=value ...]          (torchrun -> python -m torchllm.train)
    python -m torchllm.train --help                   (every config key, by section)
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from torchllm import models
from torchllm.config import ConfigError, JobConfig, help_text, load_config, to_toml
from torchllm.data import build_data, build_tokenizer
from torchllm.log import init_logger, logger
from torchllm.loss import IGNORE_INDEX
from torchllm.metrics.flops import flops_per_token, parameter_counts, peak_flops
from torchllm.metrics.memory import memory_stats, reset_peak
from torchllm.optim import build_lr_scheduler, build_optimizer
from torchllm.parallel import (
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


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present; asking for CUDA without it is a config error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("training.device = 'cuda' but no CUDA device is visible; use 'cpu'")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


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

        # Global batch = local batch x dp degree x accumulation steps.
        per_pass = tcfg.local_batch_size * self.dp_degree
        global_batch = per_pass if tcfg.global_batch_size == -1 else tcfg.global_batch_size
        if global_batch % per_pass:
            raise ConfigError(
                f"training.global_batch_size = {global_batch} is not a multiple of "
                f"local_batch_size ({tcfg.local_batch_size}) x data-parallel degree "
                f"({self.dp_degree}) = {per_pass}"
            )
        self.grad_accum_steps = global_batch // per_pass
        self.global_batch = global_batch

        self.run_dir = Path(cfg.job.dump_folder) / self.run_name(cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(to_toml(cfg))
        if cfg.job.print_config:
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
        self.batches, self.val_windows = build_data(
            cfg, self.tokenizer, self.dp_rank, self.dp_degree
        )

        # Model: built on the meta device (no memory), parallelized, then materialized.
        spec = models.get(cfg.model.name)
        self.model_args = models.model_args(cfg, self.tokenizer.vocab_size)
        with torch.device("meta"):
            self.model = spec.build(self.model_args)
        spec.parallelize_fn(self.model, self.parallel_dims, cfg)
        # Sharded or not, the initial weights equal a single CPU process's with this seed.
        init_model_weights(self.model, lambda: spec.build(self.model_args), self.device,
                           cfg.job.seed, cfg.parallelism.fsdp_cpu_offload)
        self.model.train()
        self.loss_fn = build_loss_fn(cfg.compile)

        self.optimizer = build_optimizer(self.model, cfg.optimizer, self.device)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, tcfg.steps)
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
        self.step = 0

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
        n_tokens = sum(int((y != IGNORE_INDEX).sum()) for _, y in micro_batches)
        (global_tokens,) = dp_sum([n_tokens], self.parallel_dims, self.device)
        loss_sum = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(micro_batches):
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            # Gradients are reduced across dp ranks on the last micro-step only.
            with gradient_sync(self.model, enabled=i == len(micro_batches) - 1):
                with self.autocast():
                    logits = self.model(inputs)
                loss = self.loss_fn(logits, targets)  # float32, outside autocast
                # Data-parallel gradient averaging divides by dp_degree; undo it so the
                # gradient is exactly that of the global mean.
                (loss * (self.dp_degree / global_tokens)).backward()
            loss_sum += loss.detach()
            del logits, loss
        return loss_sum, n_tokens

    def train_step(self) -> dict[str, float]:
        """One optimizer step over grad_accum_steps micro-batches; returns its metrics."""
        t0 = time.perf_counter()
        micro_batches = [next(self.batches) for _ in range(self.grad_accum_steps)]
        data_time = time.perf_counter() - t0
        loss_sum, n_tokens = self.forward_backward(micro_batches)

        max_norm = self.cfg.training.max_norm
        grad_norm = clip_grad_norm_(self.model.parameters(), max_norm)  # DTensor-aware
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # The logged loss is the mean over every token of the global batch, on all dp ranks.
        global_loss, global_tokens = dp_sum([loss_sum.item(), n_tokens], self.parallel_dims,
                                            self.device)
        return {
            "loss": global_loss / global_tokens,
            "grad_norm": grad_norm.item(),
            "lr": lr,
            "tokens": int(global_tokens),
            "data_time": data_time,
        }

    def log_line(self, m: dict[str, float], step_time: float) -> None:
        tps_global = m["tokens"] / step_time
        tps_device = tps_global / self.parallel_dims.world_size
        parts = [
            f"step {self.step:>5}/{self.cfg.training.steps}",
            f"loss {m['loss']:.4f}",
            f"lr {m['lr']:.2e}",
            f"grad_norm {m['grad_norm']:.3f}",
            f"tok/s/device {tps_device:,.0f}",
            f"tok/s {tps_global:,.0f}",
            f"step {step_time * 1000:.0f}ms",
        ]
        if self.peak_flops:
            parts.append(f"mfu {100 * tps_device * self.flops_per_token / self.peak_flops:.1f}%")
        mem = memory_stats(self.device)
        if "rss_gib" in mem:
            parts.append(f"rss {mem['rss_gib']:.2f}GiB")
        else:
            parts.append(
                f"mem {mem['max_active_gib']:.1f}GiB ({mem['max_active_pct']:.0f}%) "
                f"reserved {mem['max_reserved_gib']:.1f}GiB"
            )
        logger.info(" | ".join(parts))

    def train(self) -> list[float]:
        """Run training.steps optimizer steps; returns the loss of every step."""
        tcfg = self.cfg.training
        losses = []
        # Automatic GC pauses at random moments cost whole steps; collect on our schedule.
        gc.disable()
        start = time.perf_counter()
        try:
            while self.step < tcfg.steps:
                self.step += 1
                if self.step % tcfg.gc_freq == 0:
                    gc.collect(1)
                reset_peak(self.device)
                t0 = time.perf_counter()
                m = self.train_step()
                step_time = time.perf_counter() - t0
                losses.append(m["loss"])
                if not math.isfinite(m["loss"]):
                    raise FloatingPointError(f"loss is {m['loss']} at step {self.step}")
                if self.step % self.cfg.metrics.log_freq == 0 or self.step in (1, tcfg.steps):
                    self.log_line(m, step_time)
        finally:
            gc.enable()
        elapsed = time.perf_counter() - start
        tokens = self.step * self.global_batch * tcfg.seq_len
        logger.info(
            "done: %d steps in %.1fs, %s tokens (%.0f tok/s); loss %.4f -> %.4f (min %.4f)",
            self.step, elapsed, f"{tokens:,}", tokens / elapsed, losses[0], losses[-1],
            min(losses),
        )
        return losses


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    init_logger()
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    try:
        cfg = load_config(argv)
        trainer = Trainer(cfg)
    except ConfigError as e:
        logger.error("config error: %s", e)
        destroy_distributed()
        return 2
    try:
        trainer.train()
    except KeyboardInterrupt:
        logger.warning("interrupted at step %d; stopping", trainer.step)
        return 130
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
