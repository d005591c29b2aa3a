"""The whole configuration of a run: one attribute per TOML section."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from torchllm.config.sections import (
    ActivationCheckpoint,
    Checkpoint,
    Compile,
    Data,
    Eval,
    Float8,
    Job,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
    Validation,
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
    profiling: Profiling = field(default_factory=Profiling)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    validation: Validation = field(default_factory=Validation)
    eval: Eval = field(default_factory=Eval)

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
            "checkpoint.interval": self.checkpoint.interval,
            "training.loss_chunk_tokens": t.loss_chunk_tokens,
            "validation.freq": self.validation.freq,
            "validation.steps": self.validation.steps,
            "eval.max_new_tokens": self.eval.max_new_tokens,
            "eval.hellaswag_batch_size": self.eval.hellaswag_batch_size,
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
        for key, value in (("training.stop_after_steps", t.stop_after_steps),
                           ("training.time_limit_minutes", t.time_limit_minutes),
                           ("checkpoint.keep_latest_k", self.checkpoint.keep_latest_k)):
            if value < 0:
                raise ConfigError(f"{key} = {value}: must be >= 0 (0 = off)", key)
        if self.checkpoint.initial_load_in_hf and not self.checkpoint.initial_load_path:
            raise ConfigError(
                "checkpoint.initial_load_in_hf = true needs checkpoint.initial_load_path (a "
                "Hugging Face model folder)", "checkpoint.initial_load_in_hf",
            )
        if self.optimizer.lr <= 0:
            raise ConfigError(f"optimizer.lr = {self.optimizer.lr}: must be > 0", "optimizer.lr")
        e = self.eval
        for key, value in (("eval.sample_freq", e.sample_freq),
                           ("eval.hellaswag_freq", e.hellaswag_freq), ("eval.top_k", e.top_k),
                           ("eval.temperature", e.temperature)):
            if value < 0:
                raise ConfigError(f"{key} = {value}: must be >= 0", key)
        if not 0.0 < e.top_p <= 1.0:
            raise ConfigError(f"eval.top_p = {e.top_p}: must be in (0, 1]", "eval.top_p")
        if e.hellaswag_limit == 0 or e.hellaswag_limit < -1:
            raise ConfigError(
                f"eval.hellaswag_limit = {e.hellaswag_limit}: must be >= 1, or -1 for all",
                "eval.hellaswag_limit",
            )
        if not 0.0 <= self.data.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction = {self.data.val_fraction}: must be in [0, 1)", "data.val_fraction")
        for key in ("val_documents", "num_workers"):
            if getattr(self.data, key) < 0:
                raise ConfigError(f"data.{key} = {getattr(self.data, key)}: must be >= 0", f"data.{key}")
        for key in ("prefetch_factor", "tokenizer_vocab_size", "tokenizer_train_chars"):
            if getattr(self.data, key) < 1:
                raise ConfigError(f"data.{key} = {getattr(self.data, key)}: must be >= 1", f"data.{key}")
        self._validate_monitoring()

    def _validate_monitoring(self) -> None:
        """[metrics] guard settings and [profiling] windows."""
        m, p = self.metrics, self.profiling
        checks = [
            ("metrics.loss_spike_factor", m.loss_spike_factor,
             m.loss_spike_factor == 0 or m.loss_spike_factor > 1, "must be 0 (off) or > 1"),
            ("metrics.loss_spike_window", m.loss_spike_window, m.loss_spike_window >= 1,
             "must be >= 1"),
            ("metrics.max_consecutive_skips", m.max_consecutive_skips,
             m.max_consecutive_skips >= 0, "must be >= 0"),
            ("profiling.profile_freq", p.profile_freq, p.profile_freq >= 1, "must be >= 1"),
            ("profiling.profiler_warmup", p.profiler_warmup, p.profiler_warmup >= 0,
             "must be >= 0"),
            ("profiling.profiler_active", p.profiler_active,
             1 <= p.profiler_active <= p.profile_freq - p.profiler_warmup,
             f"must be >= 1 and fit in profile_freq - profiler_warmup "
             f"({p.profile_freq} - {p.profiler_warmup})"),
            ("profiling.memory_snapshot_freq", p.memory_snapshot_freq,
             p.memory_snapshot_freq >= 0, "must be >= 0 (0 = only on OOM)"),
        ]
        for key, value, ok, allowed in checks:
            if not ok:
                raise ConfigError(f"{key} = {value}: {allowed}", key)
