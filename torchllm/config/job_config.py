"""The whole configuration of a run: one attribute per TOML section."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from torchllm.config.sections import (
    ActivationCheckpoint,
    Compile,
    Data,
    Float8,
    Job,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Training,
)


class ConfigError(ValueError):
    """Bad configuration: raised before any work starts, with what was wrong and what to do.

    `key` ("section.name") lets the loader say which file or flag set the offending value.
    """

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    data: Data = field(default_factory=Data)
    metrics: Metrics = field(default_factory=Metrics)

    def sections(self):
        """(name, section dataclass) pairs in declaration order."""
        return [(f.name, getattr(self, f.name)) for f in fields(self)]

    def validate(self) -> None:
        """Checks that involve values only (no world size, no tokenizer); raises ConfigError."""
        t, lr = self.training, self.lr_scheduler
        positive = {
            "training.steps": t.steps,
            "training.seq_len": t.seq_len,
            "training.local_batch_size": t.local_batch_size,
            "metrics.log_freq": self.metrics.log_freq,
            "training.gc_freq": t.gc_freq,
            "model.vocab_pad_multiple": self.model.vocab_pad_multiple,
        }
        for key, value in positive.items():
            if value < 1:
                raise ConfigError(f"{key} = {value}: must be a positive integer", key)
        if t.global_batch_size != -1 and t.global_batch_size < 1:
            raise ConfigError(
                f"training.global_batch_size = {t.global_batch_size}: must be >= 1, or -1 for "
                "local_batch_size x data-parallel degree",
                "training.global_batch_size",
            )
        if lr.warmup_steps < 0:
            raise ConfigError(f"lr_scheduler.warmup_steps = {lr.warmup_steps}: must be >= 0", "lr_scheduler.warmup_steps")
        if not 0.0 <= lr.min_lr_ratio <= 1.0:
            raise ConfigError(f"lr_scheduler.min_lr_ratio = {lr.min_lr_ratio}: must be in [0, 1]", "lr_scheduler.min_lr_ratio")
        if not 0.0 < lr.decay_ratio <= 1.0:
            raise ConfigError(f"lr_scheduler.decay_ratio = {lr.decay_ratio}: must be in (0, 1]", "lr_scheduler.decay_ratio")
        if self.optimizer.lr <= 0:
            raise ConfigError(f"optimizer.lr = {self.optimizer.lr}: must be > 0", "optimizer.lr")
        if not 0.0 <= self.data.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction = {self.data.val_fraction}: must be in [0, 1)", "data.val_fraction")
