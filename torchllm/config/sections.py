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
    print_config: bool = opt(
        False, "Also print the whole effective config at start (a short run header is always "
        "printed; the full config is always written to the run folder's config.toml)"
    )
    overwrite: bool = opt(
        False, "Start afresh in a run folder that holds a previous run's outputs, deleting its "
        "checkpoints and TensorBoard events (without it such a start is refused)"
    )
    lock_stale_minutes: float = opt(
        10.0, "A run-folder lock whose holder ran on another host and has not renewed it for "
        "this long is stale and taken over (same host: taken over once its process is gone)"
    )


@dataclass
class Model:
    name: str = opt("llama3", "Model family in the registry")
    flavor: str = opt(
        "debug", "Size preset of the model family (llama3: debug, small, 125M, 1B, 3B, 8B, 70B; "
        "qwen3: debug, 0.6B, 1.7B, 4B, 8B; qwen3_moe: debug, 30B-A3B; gpt2: 124M, ...)"
    )
    vocab_size: Optional[int] = opt(
        None, "Vocab size before padding; unset = the tokenizer's (or the flavor's without one)"
    )
    vocab_pad_multiple: int = opt(64, "Pad the vocab up to a multiple of this (1 = no padding)")
    vocab_pad_pow2: bool = opt(False, "Pad the vocab up to the next power of two instead")
    max_seq_len: Optional[int] = opt(None, "RoPE table length; unset = training.seq_len")
    rope_theta: Optional[float] = opt(None, "Override the flavor's RoPE base frequency")
    rope_scaling: Optional[bool] = opt(None, "Override Llama-3.1 RoPE frequency scaling on/off")
    tie_embeddings: Optional[bool] = opt(None, "Override the flavor's tied input/output embedding")
    dropout: float = opt(
        0.0, "Dropout on attention probabilities and residual branches in training (0 = off)"
    )
    moe_aux_loss_coef: float = opt(
        0.001, "MoE models: weight of the load-balancing loss (mean over MoE layers) in the loss"
    )
    moe_z_loss_coef: float = opt(0.0, "MoE models: weight of the router z-loss; 0 = off")
    attn_mask_type: Literal["causal", "block_causal"] = opt(
        "causal", "causal | block_causal (a token attends only within its own document of the "
        "packed window)"
    )
    attention: Literal["sdpa", "flex"] = opt(
        "sdpa", "Attention kernel: sdpa (every device; causal fast path, boolean mask otherwise) "
        "| flex (FlexAttention with a block mask, compiled; CUDA only)"
    )
    sliding_window: list[int] = opt(
        [], "Sliding-window attention: [] = off, [W] = every layer sees the last W tokens, or "
        "one entry per layer (0 = full attention for that layer)"
    )
    restart_positions_per_document: bool = opt(
        False, "RoPE (GPT-2: learned) positions restart at 0 at each document of a packed window"
    )


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
        "auto", "bf16 matmuls (float32 loss, optimizer, master weights); auto = bf16 on CUDA "
        "and on CPUs with native bf16 (AVX512_BF16/AMX, confirmed by a timed probe), else none (fp32)"
    )
    tf32: bool = opt(True, "Allow TF32 matmuls/convolutions on CUDA (ignored on CPU)")
    gc_freq: int = opt(50, "Run Python garbage collection every N steps (automatic GC is off)")
    stop_after_steps: int = opt(
        0, "Run at most this many steps in this launch, save and exit 0; 0 = no limit"
    )
    time_limit_minutes: float = opt(
        0.0, "Save and exit 0 before this much wall-clock time has passed; 0 = no limit"
    )
    batch_size_ramp_tokens: int = opt(
        0, "Grow the global batch linearly from batch_size_ramp_start over this many tokens; 0 = off"
    )
    batch_size_ramp_start: int = opt(
        -1, "Global batch (sequences) at step 1 of the ramp; -1 = local_batch_size x dp degree"
    )
    batch_size_ramp_lr_scaling: bool = opt(
        False, "During the ramp, multiply the LR by sqrt(current batch / global batch)"
    )
    seq_len_schedule: str = opt(
        "", "'LEN:UNTIL,...': train at LEN up to fraction UNTIL of the steps (last UNTIL = 1.0); "
        "each LEN divides seq_len (windows are cut into LEN pieces); empty = seq_len throughout"
    )
    chunked_loss: bool = opt(
        False, "Compute the loss inside the model in token chunks, never holding the full "
        "[tokens, vocab] float32 logits (recomputed in backward)"
    )
    loss_chunk_tokens: int = opt(4096, "chunked_loss: tokens per chunk")


@dataclass
class Optimizer:
    name: Literal["adamw", "muon", "adamw8bit"] = opt(
        "adamw", "adamw | muon (Muon for the blocks' matrices, AdamW for the rest) | adamw8bit "
        "(torchao 8-bit moments)"
    )
    lr: float = opt(3e-4, "Peak learning rate")
    beta1: float = opt(0.9, "Adam beta1")
    beta2: float = opt(0.95, "Adam beta2")
    eps: float = opt(1e-8, "Adam epsilon")
    weight_decay: float = opt(0.1, "Decoupled weight decay for 2-D weights")
    decay_embeddings: bool = opt(False, "Also apply weight decay to the embedding table")
    fused: Literal["auto", "on", "off"] = opt(
        "auto", "Fused AdamW kernel; auto = on wherever the device supports it"
    )
    muon_lr: float = opt(0.02, "muon: peak learning rate of the Muon group (AdamW's is lr)")
    muon_momentum: float = opt(0.95, "muon: Nesterov momentum of the Muon group")
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = opt(
        "original", "muon: per-matrix LR scaling: original (sqrt(max(1, rows/cols))) or "
        "match_rms_adamw (0.2 sqrt(max(rows, cols)), lets muon_lr be an AdamW-like rate)"
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
    data_parallel_replicate_degree: int = opt(
        1, "Replicas of the model: DDP, or HSDP's replicate dim when data_parallel_shard_degree > 1"
    )
    data_parallel_shard_degree: int = opt(
        -1, "FSDP2 shard degree; -1 = what is left of the world after replicate x tensor_parallel"
    )
    tensor_parallel_degree: int = opt(1, "Tensor-parallel degree (divides heads and KV heads)")
    context_parallel_degree: int = opt(
        1, "Context-parallel degree: each sequence is split over this many ranks (head-tail "
        "load-balanced); keys/values are all-gathered; FSDP2 shards over dp_shard x cp"
    )
    dp_mode: Literal["fsdp", "ddp"] = opt(
        "fsdp", "A data-parallel-only run: shard with FSDP2, or replicate with DDP (no sharding)"
    )
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = opt(
        "default",
        "Free gathered params after forward (always: least memory; never: no all-gather in "
        "backward; default: always, except the last block, which backward needs first)",
    )
    fsdp_reduce_dtype: Literal["float32", "bf16"] = opt(
        "float32", "Gradient reduce-scatter dtype under FSDP2 (param dtype follows "
        "training.mixed_precision)"
    )
    fsdp_cpu_offload: bool = opt(
        False, "Keep sharded params, grads and optimizer state in CPU memory (slow; CUDA only)"
    )
    ddp_bucket_cap_mb: int = opt(25, "DDP gradient bucket size in MiB")
    ddp_comm_hook: Literal["none", "bf16", "fp16"] = opt(
        "none", "DDP gradient compression: all-reduce gradients in bf16 or fp16"
    )


@dataclass
class Comm:
    init_timeout_seconds: int = opt(
        1800, "Collective timeout until the first step ends (rank 0 may train the tokenizer, "
        "build a large model or compile alone meanwhile)"
    )
    train_timeout_seconds: int = opt(
        600, "Collective timeout from the end of the first step on (a hung rank fails the run "
        "after this long)"
    )


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = opt(
        "none", "Recompute activations in backward: none, full (every block), selective"
    )
    selective_option: str = opt(
        "op",
        "selective only: 'op' (save matmul/attention outputs, recompute the rest), an integer N "
        "(every Nth block in full), 'ffn' or 'attention' (only that submodule of every block)",
    )


@dataclass
class Compile:
    enable: bool = opt(False, "torch.compile each transformer block (and the loss)")
    components: list[Literal["model", "loss"]] = opt(["model", "loss"], "What to compile")
    backend: Literal["inductor", "aot_eager", "eager", "cudagraphs"] = opt(
        "inductor", "torch.compile backend (inductor; aot_eager or eager to debug)"
    )


@dataclass
class Float8:
    enable: bool = opt(False, "Train nn.Linear layers with float8 matmuls (torchao; SM89+ GPUs)")
    recipe: Literal["tensorwise", "rowwise"] = opt(
        "tensorwise", "Scaling granularity: tensorwise (fastest) or rowwise (more accurate)"
    )
    emulate: bool = opt(
        False, "Emulate float8 matmuls in high precision (any device; for tests, not speed)"
    )
    enable_fsdp_float8_all_gather: bool = opt(
        True, "tensorwise + FSDP2: all-gather weights in float8 (half the traffic of bf16)"
    )
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(
        True, "With float8 all-gather: compute all weight scales in one op after each step"
    )
    filter_fqns: list[str] = opt(
        ["output"], "Linear layers whose name contains any of these stay in high precision"
    )


@dataclass
class DataSource:
    """One weighted source of a mixture: a `[[data.sources]]` table."""

    dataset: str = opt("", "Any data.dataset value (local:, shards:, embedded, ...)")
    weight: float = opt(1.0, "Share of the training tokens (weights are normalized to sum 1)")


@dataclass
class Data:
    dataset: str = opt(
        "embedded",
        "embedded (CPython's docs, no download) | fineweb_edu | fineweb_edu_100b | hf:NAME | "
        "local:PATH (.txt/.jsonl/.parquet file, glob or folder) | shards:DIR (from prepare)",
    )
    tokenizer: str = opt(
        "auto",
        "SentencePiece/tiktoken .model, .tiktoken, tokenizer.json, Hub name; auto = train a "
        "SentencePiece model on the corpus (shards: the one in index.json)",
    )
    tokenizer_vocab_size: int = opt(4096, "Vocab size when auto-training a tokenizer")
    tokenizer_train_chars: int = opt(
        50_000_000, "Characters of the corpus read when auto-training a tokenizer"
    )
    text_column: str = opt("text", "Column holding the text in .jsonl/.parquet/Hub rows")
    hf_subset: str = opt("", "Hugging Face dataset subset (config name); empty = the registry's")
    hf_split: str = opt("", "Hugging Face dataset split; empty = the registry's, else 'train'")
    val_fraction: float = opt(
        0.05, "embedded/local: fraction of the tokens (the end of the corpus) held out"
    )
    val_documents: int = opt(
        1000, "Hugging Face streams: the first N documents are held out for validation"
    )
    shuffle_windows: bool = opt(
        True, "Shuffle windows within each shard (in-memory corpora: all windows) every epoch"
    )
    sources: list[DataSource] = opt(
        [], "A mixture instead of data.dataset: [[data.sources]] tables of dataset + weight "
        "(token fractions); CLI: DATASET=WEIGHT,DATASET=WEIGHT. See docs/data.md"
    )
    chat_column: str = opt("messages", "chat: sources: column of [{role, content}] lists")
    chat_packing: Literal["pack", "pad"] = opt(
        "pack", "chat: whole conversations per window (pack) or one per window (pad)")
    chat_tokens: bool = opt(
        False, "Add the chat tokens (<|user_start|>...) to a tokenizer without a chat template, "
        "also without chat: sources (so a base model can be fine-tuned on chat later)")
    num_workers: int = opt(0, "Loader worker processes per rank (0 = load in the trainer)")
    prefetch_factor: int = opt(2, "Batches each loader worker prepares ahead")


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log metrics (console line, TensorBoard, W&B) every N steps")
    enable_tensorboard: bool = opt(True, "Write TensorBoard event files to dump_folder/tb_folder/<run>")
    tb_folder: str = opt("tb", "TensorBoard folder under job.dump_folder (one subfolder per run)")
    rank_0_only: bool = opt(True, "Only rank 0 writes TensorBoard/W&B; false = one folder per rank")
    enable_wandb: bool = opt(False, "Also log to Weights & Biases (needs the wandb package)")
    wandb_project: str = opt("torchllm", "W&B project name")
    progress_bar: bool = opt(True, "Live progress bar with ETA when the console is a terminal")
    guard_policy: Literal["warn", "skip_step", "stop"] = opt(
        "skip_step", "On a non-finite loss/grad norm or a loss spike: warn, drop the update, or stop"
    )
    loss_spike_factor: float = opt(
        3.0, "A loss above this multiple of its running mean is a spike; 0 disables the check"
    )
    loss_spike_window: int = opt(50, "Steps in the loss running mean (spikes checked once full)")
    max_consecutive_skips: int = opt(
        10, "skip_step: stop after this many skipped steps in a row; 0 = never"
    )


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "Record torch profiler traces, one file per rank")
    profile_freq: int = opt(100, "Trace the last `active` steps of every window of N steps")
    profiler_warmup: int = opt(3, "Profiler warm-up steps before each traced window (not saved)")
    profiler_active: int = opt(1, "Steps recorded in each trace")
    traces_folder: str = opt("profile_traces", "Trace folder under the run folder")
    enable_memory_snapshot: bool = opt(
        False, "CUDA only: record allocator history; dump snapshots on OOM and every snapshot_freq"
    )
    memory_snapshot_freq: int = opt(0, "Dump a memory snapshot every N steps; 0 = only on OOM")
    memory_snapshot_folder: str = opt("memory_snapshot", "Snapshot folder under the run folder")


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
    exclude_from_loading: list[
        Literal["model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng",
                "loss_guard"]
    ] = opt([], "States not to restore when resuming")
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
    checksums: bool = opt(
        True, "Record each file's CRC-32 in the COMPLETE marker and verify it when loading"
    )
    on_save_error: Literal["stop", "continue"] = opt(
        "stop", "A failed save (disk full, I/O error): stop the run (exit 4), or continue and "
        "retry at the next interval"
    )
    optimizer_hparams_from: Literal["checkpoint", "config"] = opt(
        "checkpoint", "On resume, peak LR/betas/eps/weight decay: the checkpoint's, or this "
        "config's (the LR schedule continues at the resumed step)"
    )
    allow_global_batch_change: bool = opt(
        False, "Allow resuming with another global batch size than the checkpoint's"
    )


@dataclass
class Validation:
    enable: bool = opt(False, "Compute the validation loss during training")
    freq: int = opt(250, "Validate every N steps (and after the last step)")
    steps: int = opt(
        10, "Batches per validation of a held-out split, the same ones every time (fewer if too "
        "few); a dedicated validation.dataset is read whole instead"
    )
    dataset: str = opt(
        "", "A dedicated validation dataset (same forms as data.dataset), read whole up to "
        "validation.max_tokens; empty = the held-out split of data.dataset"
    )
    max_tokens: int = opt(
        1_000_000, "validation.dataset: validate on its first N tokens (all of it when smaller)"
    )
    split: str = opt(
        "", "Hugging Face split to validate on (e.g. validation); empty = held out from training"
    )


@dataclass
class Eval:
    sample_freq: int = opt(0, "Complete eval.prompts every N steps during training; 0 = off")
    prompts: list[str] = opt(["The meaning of life is"], "Prompts completed during training")
    max_new_tokens: int = opt(32, "Tokens generated per prompt")
    temperature: float = opt(0.8, "Sampling temperature; 0 = greedy (argmax)")
    top_k: int = opt(50, "Sample among the k most likely tokens; 0 = no limit")
    top_p: float = opt(1.0, "Sample from the smallest set of tokens with this total probability")
    hellaswag_freq: int = opt(0, "Run HellaSwag every N steps during training; 0 = off")
    hellaswag_data: str = opt(
        "Rowan/hellaswag", "HellaSwag source: an official-format .jsonl file, or a Hub dataset name"
    )
    hellaswag_limit: int = opt(500, "Examples scored during training (the first N); -1 = all")
    hellaswag_batch_size: int = opt(4, "Examples per forward pass (each is 4 rows)")
    tasks: list[str] = opt(
        [], "Downstream (CORE-style) tasks, 'name' or 'name:K' for K-shot; see docs/evaluation.md"
    )
    tasks_freq: int = opt(0, "Run the downstream tasks every N steps during training; 0 = off")
    tasks_limit: int = opt(100, "Rows scored per task (the first N; the budget knob); -1 = all")
    tasks_fewshot: int = opt(0, "Solved examples before each question, for tasks without ':K'")
    tasks_batch_size: int = opt(8, "Task rows per forward pass (each is one row per option)")
    tasks_data_dir: str = opt(
        "", "Folder of local task copies (<task>/ from save_to_disk, or <task>.jsonl); '' = Hub"
    )
