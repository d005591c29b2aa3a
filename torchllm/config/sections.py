"""Typed config sections: one dataclass per TOML table, every field with a one-line help.

These dataclasses are the single source of truth for configuration: TOML files, CLI overrides,
`--help`, the written `config.toml` and `docs/config.md` are all derived from them.
A field's help string lives in its metadata; `opt()` keeps the declarations short.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


def opt(default, help: str):
    """A dataclass field with a default and a help string (lists get a default_factory)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class Job:
    config_file: Optional[str] = opt(None, "TOML file to load before applying CLI overrides")
    dump_folder: str = opt("./outputs", "Root folder for everything a run writes")
    run_name: str = opt("", "Subfolder of dump_folder for this run; empty = the config file's stem")
    description: str = opt("", "Free-text description printed at start")
    seed: int = opt(42, "Seed for model init, data order and sampling")
    deterministic: bool = opt(
        False, "Use deterministic algorithms (and cuDNN/cuBLAS settings) at some speed cost"
    )
    print_config: bool = opt(True, "Print the effective config at start (rank 0)")


@dataclass
class Model:
    name: str = opt("llama3", "Model family in the registry")
    flavor: str = opt("debug", "Size preset of the model family (debug, 125M, 1B, 3B, 8B, 70B)")
    vocab_size: Optional[int] = opt(
        None, "Vocab size before padding; unset = the tokenizer's (or the flavor's without one)"
    )
    vocab_pad_multiple: int = opt(64, "Pad the vocab up to a multiple of this (1 = no padding)")
    vocab_pad_pow2: bool = opt(False, "Pad the vocab up to the next power of two instead")
    max_seq_len: Optional[int] = opt(None, "RoPE table length; unset = training.seq_len")
    rope_theta: Optional[float] = opt(None, "Override the flavor's RoPE base frequency")
    rope_scaling: Optional[bool] = opt(None, "Override Llama-3.1 RoPE frequency scaling on/off")
    tie_embeddings: Optional[bool] = opt(None, "Override the flavor's tied input/output embedding")


@dataclass
class Training:
    steps: int = opt(1000, "Optimizer steps of the whole run (the LR schedule spans these)")
    seq_len: int = opt(2048, "Tokens per sequence")
    local_batch_size: int = opt(8, "Sequences per micro-batch on one device")
    global_batch_size: int = opt(
        -1, "Sequences per optimizer step over all ranks; -1 = local_batch_size x dp degree"
    )
    max_norm: float = opt(1.0, "Clip the total gradient norm to this; <= 0 disables clipping")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "auto = CUDA when available, else CPU")
    mixed_precision: Literal["auto", "bf16", "none"] = opt(
        "auto", "bf16 autocast; auto = bf16 on CUDA, none (fp32) on CPU"
    )
    tf32: bool = opt(True, "Allow TF32 matmuls/convolutions on CUDA (ignored on CPU)")
    gc_freq: int = opt(50, "Run Python garbage collection every N steps (automatic GC is off)")
    stop_after_steps: int = opt(
        0, "Run at most this many steps in this launch, save and exit 0; 0 = no limit"
    )
    time_limit_minutes: float = opt(
        0.0, "Save and exit 0 before this much wall-clock time has passed; 0 = no limit"
    )


@dataclass
class Optimizer:
    name: Literal["adamw"] = opt("adamw", "Optimizer")
    lr: float = opt(3e-4, "Peak learning rate")
    beta1: float = opt(0.9, "Adam beta1")
    beta2: float = opt(0.95, "Adam beta2")
    eps: float = opt(1e-8, "Adam epsilon")
    weight_decay: float = opt(0.1, "Decoupled weight decay for 2-D weights")
    decay_embeddings: bool = opt(False, "Also apply weight decay to the embedding table")
    fused: Literal["auto", "on", "off"] = opt(
        "auto", "Fused AdamW kernel; auto = on wherever the device supports it"
    )


@dataclass
class LRScheduler:
    warmup_steps: int = opt(200, "Linear warmup from ~0 to optimizer.lr over this many steps")
    decay_type: Literal["cosine", "linear", "wsd"] = opt(
        "cosine", "Shape after warmup: cosine, linear, or warmup-stable-decay"
    )
    decay_ratio: float = opt(
        0.2, "wsd only: fraction of steps spent in the final (linear) decay"
    )
    min_lr_ratio: float = opt(0.1, "Final learning rate as a fraction of optimizer.lr")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(1, "Replicas (DDP or the HSDP replicate dim)")
    data_parallel_shard_degree: int = opt(-1, "FSDP shard degree; -1 = what is left of the world")
    tensor_parallel_degree: int = opt(1, "Tensor-parallel degree")


@dataclass
class Data:
    dataset: str = opt("embedded", "Dataset: embedded (CPython's bundled docs, no download)")
    tokenizer: str = opt(
        "auto", "Tokenizer file or name; auto = train a SentencePiece model on the corpus"
    )
    tokenizer_vocab_size: int = opt(4096, "Vocab size when auto-training a tokenizer")
    val_fraction: float = opt(0.05, "Fraction of the corpus held out for validation")


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log a console line every N steps")


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save checkpoints, and resume from the run's latest one at start")
    folder: str = opt("checkpoint", "Subfolder of the run folder that holds step-<N> checkpoints")
    interval: int = opt(500, "Save every N steps (and at the last step of the run)")
    keep_latest_k: int = opt(3, "Keep only the newest K complete checkpoints; 0 keeps all")
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = opt(
        "disabled", "async: stage to CPU, write in a background thread; pinned_mem: CUDA only"
    )
    load_step: int = opt(-1, "Step to resume from; -1 = the latest complete checkpoint")
    exclude_from_loading: list[str] = opt(
        [], "States not to restore: model, optimizer, lr_scheduler, dataloader, train_state, rng"
    )
    initial_load_path: str = opt(
        "", "Checkpoint (run, folder or step dir) to start from when the run has none of its own"
    )
    initial_load_model_only: bool = opt(True, "Take only the weights from initial_load_path")
    initial_load_in_hf: bool = opt(
        False, "initial_load_path is a Hugging Face model folder (config.json + safetensors)"
    )
    last_save_model_only: bool = opt(
        False, "Make the final save weights-only (in export_dtype), e.g. for export"
    )
    export_dtype: Literal["float32", "bfloat16", "float16"] = opt(
        "float32", "dtype of the weights in a weights-only final save"
    )
    create_seed_checkpoint: bool = opt(
        False, "Initialize the model, save it as step-0 (weights only) and exit"
    )
