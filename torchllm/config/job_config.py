"""The whole configuration of a run: one attribute per TOML section."""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, fields, is_dataclass

from torchllm.config import components
from torchllm.config.fields import ANY
from torchllm.config.paths import path_errors
from torchllm.config.sections_ft import FaultTolerance, fault_tolerance_errors
from torchllm.config.sections import (
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    Data,
    Eval,
    Float8,
    Job,
    LRScheduler,
    Lora,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
    Validation,
)


def _floats(prefix: str, obj, what: str = ""):
    """(dotted key, value, allowed Range, what) of every float value of a section dataclass;
    list-of-table items are named key[i].field and described by their first field (`what`)."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        key, value, tp = f"{prefix}.{f.name}", getattr(obj, f.name), hints[f.name]
        if value is not None and float in (tp, *typing.get_args(tp)):
            yield key, float(value), f.metadata.get("allowed", ANY), what
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if is_dataclass(item):
                    first = getattr(item, fields(item)[0].name)
                    yield from _floats(f"{key}[{i}]", item, f" ({first})")


# A data.dataset value "PACKING:LOCATION" reads LOCATION's rows with that packing (how rows become
# windows: torchllm/data/packing/); any other value is a source whose text is packed into windows.
TEXT = "text"  # a source's documents, concatenated into windows
CHAT = "chat"  # "chat:PATH", "chat:hf:NAME": conversations, the loss on the assistant's turns
PACKINGS = (CHAT,)  # the prefixes that name a packing


def data_packing(spec) -> tuple[str, str | None]:
    """(packing, location) of a data.dataset value: (CHAT, LOCATION) for "chat:LOCATION";
    (TEXT, None) for every other (a source spec, read as text)."""
    prefix, sep, location = str(spec).partition(":")
    return (prefix, location) if sep and prefix in PACKINGS else (TEXT, None)


def reads_conversations(dcfg) -> bool:
    """Whether a data config trains on conversations (data.dataset, or with [[data.sources]]
    any of them, is read with the chat packing), by the specs alone: for finished runs too,
    nothing is read."""
    specs = [s.dataset for s in dcfg.sources] or [dcfg.dataset]
    return any(data_packing(spec)[0] == CHAT for spec in specs)


def document_masking(mcfg, dcfg) -> tuple[str, bool]:
    """(model.attn_mask_type, model.restart_positions_per_document) of the [model] section
    `mcfg` with their "unset" values resolved by the [data] section `dcfg`: conversations (chat:
    sources) are independent by default, so a packed window's conversations neither see each
    other nor continue each other's positions (block_causal, restarted positions); every other
    data keeps plain causal attention over the window."""
    chat = reads_conversations(dcfg)
    mask, restart = mcfg.attn_mask_type, mcfg.restart_positions_per_document
    return (("block_causal" if chat else "causal") if mask == "auto" else mask,
            chat if restart is None else restart)


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
    # [model] and [optimizer]: the shared keys plus the default entry's own (components.py).
    model: Model = field(default_factory=lambda: components.default_section("model", Model))
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(
        default_factory=lambda: components.default_section("optimizer", Optimizer))
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    comm: Comm = field(default_factory=Comm)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    lora: Lora = field(default_factory=Lora)
    data: Data = field(default_factory=Data)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    validation: Validation = field(default_factory=Validation)
    eval: Eval = field(default_factory=Eval)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)

    def sections(self):
        """(name, section dataclass) pairs in declaration order."""
        return [(f.name, getattr(self, f.name)) for f in fields(self)]

    def value(self, key: str):
        """The value of a dotted key, e.g. "training.steps"."""
        section, name = key.split(".")
        return getattr(getattr(self, section), name)

    def rules(self) -> list[tuple[str, bool, str]]:
        """(key, whether its value is allowed, what is allowed) for every value-only check."""
        t, p, e = self.training, self.profiling, self.eval  # float keys: float_errors()
        positive = [
            "training.steps", "training.seq_len", "training.local_batch_size", "training.gc_freq",
            "training.loss_chunk_tokens", "model.vocab_pad_multiple", "metrics.log_freq",
            "checkpoint.interval", "validation.freq", "validation.steps",
            "eval.max_new_tokens", "eval.hellaswag_batch_size", "eval.tasks_batch_size",
            "comm.init_timeout_seconds", "comm.train_timeout_seconds", "lora.rank",
        ]
        at_least_one = ["data.prefetch_factor", "data.tokenizer_vocab_size",
                        "data.tokenizer_train_chars", "metrics.loss_spike_window",
                        "profiling.profile_freq"]
        off_or_more = ["training.stop_after_steps", "checkpoint.keep_latest_k"]
        at_least_zero = ["lr_scheduler.warmup_steps", "eval.sample_freq", "eval.hellaswag_freq",
                         "eval.top_k", "eval.tasks_freq",
                         "eval.tasks_fewshot", "data.val_documents", "data.num_workers",
                         "validation.max_tokens",
                         "metrics.max_consecutive_skips", "profiling.profiler_warmup"]
        return [
            *[(k, self.value(k) >= 1, "must be a positive integer") for k in positive],
            *[(k, self.value(k) >= 1, "must be >= 1") for k in at_least_one],
            *[(k, self.value(k) >= 0, "must be >= 0 (0 = off)") for k in off_or_more],
            *[(k, self.value(k) >= 0, "must be >= 0") for k in at_least_zero],
            ("job.seed", 0 <= self.job.seed < 2**32,
             "must be an integer from 0 to 4294967295 (2**32 - 1: numpy's seeds)"),
            ("training.global_batch_size", t.global_batch_size == -1 or t.global_batch_size >= 1,
             "must be >= 1, or -1 for local_batch_size x data-parallel degree"),
            ("eval.hellaswag_limit", e.hellaswag_limit >= 1 or e.hellaswag_limit == -1,
             "must be >= 1, or -1 for all"),
            ("eval.tasks_limit", e.tasks_limit >= 1 or e.tasks_limit == -1,
             "must be >= 1, or -1 for all"),
            ("profiling.profiler_active",
             1 <= p.profiler_active <= p.profile_freq - p.profiler_warmup,
             f"must be >= 1 and fit in profile_freq - profiler_warmup "
             f"({p.profile_freq} - {p.profiler_warmup})"),
            ("profiling.memory_snapshot_freq", p.memory_snapshot_freq >= 0,
             "must be >= 0 (0 = only on OOM)"),
            ("activation_checkpoint.selective_option",
             self.activation_checkpoint.selective_option in ("op", "ffn", "attention")
             or (self.activation_checkpoint.selective_option.isdigit()
                 and int(self.activation_checkpoint.selective_option) >= 1),
             "use 'op', 'ffn', 'attention', or a positive integer N (every Nth block)"),
        ]

    def float_errors(self) -> list[tuple[str, str]]:
        """(key, message) for every float value outside its field's declared Range (nan and
        inf are outside every Range), `[[data.sources]]` weights included."""
        errors = []
        for section, obj in self.sections():
            for key, value, allowed, what in _floats(section, obj):
                if value not in allowed:
                    errors.append((key.split("[")[0], f"{key} = {value}{what}: must be {allowed}"))
        weights = [s.weight for s in self.data.sources]
        if not errors and not math.isfinite(sum(weights)):
            errors.append(("data.sources", f"data.sources: the weights {weights} sum to "
                           f"{sum(weights)}; use shares of a usual scale (e.g. summing to 1)"))
        return errors

    def validate(self) -> None:
        """Checks that involve values only (no world size, no tokenizer); raises ConfigError."""
        for key, message in self.float_errors():
            raise ConfigError(message, key)
        for key, ok, allowed in self.rules():
            if not ok:
                raise ConfigError(f"{key} = {self.value(key)}: {allowed}", key)
        for key, message in path_errors(self.job, self.checkpoint, self.profiling, self.metrics):
            raise ConfigError(message, key)
        for key, message in fault_tolerance_errors(
                self.fault_tolerance, self.checkpoint, self.training.device,
                self.parallelism.pipeline_parallel_degree):
            raise ConfigError(message, key)
        if self.data.tokenizer == "from_initial_load" and not self.checkpoint.initial_load_path:
            raise ConfigError(
                "data.tokenizer = 'from_initial_load' takes the tokenizer of the run at "
                "checkpoint.initial_load_path, which is empty; set checkpoint.initial_load_path "
                "to the previous stage's run folder, or name the tokenizer in data.tokenizer",
                "data.tokenizer",
            )
        if self.validation.stop_at_loss and not self.validation.enable:
            raise ConfigError(
                f"validation.stop_at_loss = {self.validation.stop_at_loss} stops at a validation "
                "loss, and validation.enable is false; set validation.enable = true (or "
                "validation.stop_at_loss = 0)", "validation.stop_at_loss",
            )
        if self.checkpoint.initial_load_in_hf and not self.checkpoint.initial_load_path:
            raise ConfigError(
                "checkpoint.initial_load_in_hf = true needs checkpoint.initial_load_path (a "
                "Hugging Face model folder)", "checkpoint.initial_load_in_hf",
            )
