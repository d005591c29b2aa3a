"""Typed config sections: one dataclass per TOML table, every field with a one-line help.

These dataclasses are the single source of truth for configuration: TOML files, CLI overrides,
`--help`, the written `config.toml` and `docs/config.md` are all derived from them.
A field's help string lives in its metadata; `opt()` keeps the declarations short.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from torchllm.config.fields import BELOW_ONE, FRACTION, NON_NEGATIVE, POSITIVE, Range, opt


@dataclass
class Job:
    config_file: Optional[str] = opt(None, "TOML file to load before applying CLI overrides")
    dump_folder: str = opt("./outputs", "Root folder for everything a run writes")
    run_name: Optional[str] = opt(
        None, "This run's folder under dump_folder: one folder name (no '/', not '.' or '..'); "
        "unset = the config file's stem"
    )
    description: str = opt("", "Free-text description printed at start")
    seed: int = opt(42, "Seed for model init, data order and sampling (0 to 2**32 - 1)")
    deterministic: bool = opt(
        False, "Use deterministic algorithms (and cuDNN/cuBLAS settings) at some speed cost"
    )
    print_config: bool = opt(
        False, "Also print the whole effective config at start (a short run header is always "
        "printed; the full config is always written to the run folder's config.toml)"
    )
    overwrite: bool = opt(
        False, "Start afresh in a run folder that holds a previous run's outputs, deleting its "
        "checkpoint folder and its TensorBoard folder, nothing else (without it such a start "
        "is refused)"
    )
    custom_import: Optional[str] = opt(
        None, "Dotted path of a module to import when the config is loaded, before the model is "
        "looked up: a model family or an optimizer outside torchllm registers itself there "
        "(docs/howto_model_family.md, docs/howto_optimizer.md); it must be importable from the "
        "working directory or PYTHONPATH. It RUNS that module's code: it is taken from your own "
        "config and command line only, never from a checkpoint's config.toml (generate, evals, "
        "export and initial loads drop it there; pass it on your command line to use it)"
    )
    lock_stale_minutes: float = opt(
        10.0, "A run-folder lock whose holder ran on another host and has not renewed it for "
        "this long is stale and taken over (same host: taken over once its process is gone)",
        POSITIVE,
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
    # A family's shape keys (dim, n_layers, ...: unset = the flavor's value) are its own: the
    # dataclass its folder declares (torchllm/models/<family>/config.py, config/components.py).
    vocab_pad_multiple: int = opt(64, "Pad the vocab up to a multiple of this (1 = no padding)")
    vocab_pad_pow2: bool = opt(False, "Pad the vocab up to the next power of two instead")
    max_seq_len: Optional[int] = opt(None, "RoPE table length; unset = training.seq_len")
    rope_theta: Optional[float] = opt(
        None, "Override the flavor's RoPE base frequency", POSITIVE
    )
    rope_scaling: Optional[bool] = opt(None, "Override Llama-3.1 RoPE frequency scaling on/off")
    tie_embeddings: Optional[bool] = opt(None, "Override the flavor's tied input/output embedding")
    dropout: float = opt(
        0.0, "Dropout on attention probabilities and residual branches in training (0 = off)",
        BELOW_ONE,
    )
    moe_aux_loss_coef: float = opt(
        0.001, "MoE models: weight of the load-balancing loss (mean over MoE layers) in the loss",
        NON_NEGATIVE,
    )
    moe_z_loss_coef: float = opt(
        0.0, "MoE models: weight of the router z-loss; 0 = off", NON_NEGATIVE
    )
    moe_bias_update_rate: float = opt(
        0.0, "MoE models: auxiliary-loss-free balancing (DeepSeek-V3): after each step every "
        "expert's routing bias moves by this much towards balance (+ if underloaded, - if "
        "overloaded); the bias steers top-k selection only, not the gate weights; 0 = off",
        NON_NEGATIVE,
    )
    attn_mask_type: Literal["auto", "causal", "block_causal"] = opt(
        "auto", "causal | block_causal (a token attends only within its own document of the "
        "packed window) | auto = block_causal when the data has chat: sources (each "
        "conversation independent), else causal"
    )
    attention: Literal["sdpa", "flex"] = opt(
        "sdpa", "Attention kernel: sdpa (every device; causal fast path, boolean mask otherwise) "
        "| flex (FlexAttention with a block mask, compiled; CUDA only)"
    )
    sdpa_backend: Literal["auto", "cudnn", "flash", "efficient", "math"] = opt(
        "auto", "attention = sdpa: the kernels SDPA may pick (torch.nn.attention.sdpa_kernel): "
        "auto = torch's choice | cudnn, efficient (CUDA only) | flash (no mask: causal only) | "
        "math (reference); a speed lever, measured by benchmarks/bench_gpu.py"
    )
    sliding_window: list[int] = opt(
        [], "Sliding-window attention: [] = off, [W] = every layer sees the last W tokens, or "
        "one entry per layer (0 = full attention for that layer)"
    )
    restart_positions_per_document: Optional[bool] = opt(
        None, "RoPE (GPT-2: learned) positions restart at 0 at each document of a packed window; "
        "unset = on when the data has chat: sources, else off"
    )


@dataclass
class Training:
    steps: int = opt(1000, "Optimizer steps of the whole run (the LR schedule spans these)")
    seq_len: int = opt(2048, "Tokens per sequence")
    local_batch_size: int = opt(8, "Sequences per micro-batch on one device")
    global_batch_size: int = opt(
        -1, "Sequences per optimizer step over all ranks; -1 = local_batch_size x dp degree"
    )
    max_norm: float = opt(
        1.0, "Clip the total gradient norm to this; <= 0 disables clipping",
        Range(text="a finite number (<= 0 disables clipping)"),
    )
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "auto = CUDA when available, else CPU")
    mixed_precision: Literal["auto", "bf16", "none"] = opt(
        "auto", "bf16 matmuls (float32 loss, optimizer, master weights); auto = bf16 on CUDA "
        "and on CPUs with native bf16 (AVX512_BF16/AMX, confirmed by a timed probe on every "
        "rank: bf16 only if all agree), else none (fp32)"
    )
    tf32: bool = opt(True, "Allow TF32 matmuls/convolutions on CUDA (ignored on CPU)")
    cpu_keep_freed_memory: bool = opt(
        True, "CPU with glibc: keep freed memory in the process for the next step (no mmap for "
        "large blocks, no trimming) instead of page-faulting logits-sized buffers back every "
        "step; false = the C library's defaults (memory returns to the OS sooner)"
    )
    gc_freq: int = opt(50, "Run Python garbage collection every N steps (automatic GC is off)")
    stop_after_steps: int = opt(
        0, "Run at most this many steps in this launch, save and exit 0; 0 = no limit"
    )
    time_limit_minutes: float = opt(
        0.0, "Save and exit 0 before this much wall-clock time has passed; 0 = no limit",
        NON_NEGATIVE,
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
    chunked_loss_impl: Literal["torch", "liger"] = opt(
        "torch", "chunked_loss: torch (every device) | liger (liger-kernel's fused linear "
        "cross entropy, Triton; CUDA only, pip install liger-kernel)"
    )
    cast_weights_once: bool = opt(
        False, "bf16 on one device: cast the linear weights to bf16 once per optimizer step "
        "(not once per use in every micro-step) and add each micro-step's bf16 weight gradient "
        "into the float32 gradient directly; same numbers as autocast, +2 bytes/parameter"
    )


@dataclass
class Optimizer:
    name: str = opt(
        "adamw", "Optimizer in the registry (torchllm/optim/): adamw, muon (Muon for the blocks' "
        "matrices, AdamW for the rest) or adamw8bit (torchao 8-bit moments); a module named by "
        "job.custom_import can register more (docs/howto_optimizer.md)"
    )
    lr: float = opt(3e-4, "Peak learning rate", POSITIVE)
    beta1: float = opt(0.9, "Adam beta1", BELOW_ONE)
    beta2: float = opt(0.95, "Adam beta2", BELOW_ONE)
    eps: float = opt(1e-8, "Adam epsilon", POSITIVE)
    weight_decay: float = opt(0.1, "Decoupled weight decay for 2-D weights", NON_NEGATIVE)
    decay_embeddings: bool = opt(False, "Also apply weight decay to the embedding table")
    fused: Literal["auto", "on", "off"] = opt(
        "auto", "Fused AdamW kernel; auto = on wherever the device supports it"
    )
    muon_lr: float = opt(
        0.02, "muon: peak learning rate of the Muon group (AdamW's is lr)", POSITIVE
    )
    muon_momentum: float = opt(
        0.95, "muon: Nesterov momentum of the Muon group", BELOW_ONE
    )
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
        0.2, "wsd only: fraction of steps spent in the final (linear) decay",
        Range(0, 1, lo_open=True),
    )
    min_lr_ratio: float = opt(
        0.1, "Final learning rate as a fraction of optimizer.lr", FRACTION
    )


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
    expert_parallel_degree: int = opt(
        1, "Expert parallelism (MoE models): experts sharded over this many ranks, tokens sent to "
        "them by all-to-all; borrows ranks from data_parallel_shard_degree x context_parallel_degree"
    )
    # -- pipeline parallelism (torchllm.parallel.pipeline) --
    pipeline_parallel_degree: int = opt(
        1, "Pipeline stages' ranks: the model's blocks are split over this many ranks (the "
        "outermost mesh dim)"
    )
    pipeline_parallel_schedule: Literal[
        "1F1B", "Interleaved1F1B", "GPipe", "ZBVZeroBubble", "InterleavedZeroBubble"
    ] = opt(
        "1F1B", "torch.distributed.pipelining schedule; Interleaved1F1B, InterleavedZeroBubble "
        "and ZBVZeroBubble run 2 stages per rank"
    )
    pipeline_parallel_microbatch_size: int = opt(
        1, "Sequences per pipeline micro-batch; local_batch_size / this = micro-batches per "
        "pipeline step"
    )
    pipeline_parallel_layers_per_stage: int = opt(
        0, "Blocks per stage (the embedding and the output head count as one block each, on "
        "the first and last stage); 0 = automatic, balanced"
    )
    pipeline_parallel_split_points: list[str] = opt(
        [], "Explicit stage boundaries: the blocks that start stages 1.., e.g. ['layers.2']; "
        "overrides layers_per_stage"
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
    fsdp_reduce_every_microstep: bool = opt(
        True, "Under gradient accumulation, reduce-scatter FSDP2 gradients after every "
        "micro-step, so they stay sharded (1/shard of the fp32 grads per rank); false: keep "
        "unsharded grads until the last micro-step (one reduce-scatter per step, the whole "
        "model's fp32 grads on every rank; for communication-bound runs)"
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
    granularity: Literal["block", "model"] = opt(
        "block", "block = compile each transformer block (shared code, works with FSDP2/DDP/"
        "TP/PP) | model = the whole model as one graph (one device only)"
    )
    cudagraphs: bool = opt(
        False, "inductor: replay the compiled graphs as CUDA graphs (fewer kernel launches; "
        "CUDA only)"
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
class Lora:
    enable: bool = opt(
        False, "LoRA fine-tuning: freeze every base weight and train a low-rank update B @ A "
        "(x alpha / rank) beside each targeted linear layer (docs/lora.md)"
    )
    rank: int = opt(8, "Rank r of each adapter (A: r x in, B: out x r)")
    alpha: float = opt(16.0, "Scale of the update: alpha / rank", POSITIVE)
    dropout: float = opt(0.0, "Dropout on the adapters' input in training (0 = off)", BELOW_ONE)
    target_modules: list[str] = opt(
        [], "Linear layers that get adapters, by their name in a block (llama3, qwen3: wq, wk, "
        "wv, wo, w1, w2, w3; qwen3_moe: wq, wk, wv, wo; gpt2: wq, wk, wv, wo, w1, w2); [] = "
        "all of the family's"
    )
    train_embeddings: bool = opt(
        False, "Also train the embedding table(s) and the output head (whole, not low-rank)"
    )
    train_new_tokens: bool = opt(
        True, "When the run's tokenizer adds chat tokens to its base (data.chat_tokens, chat "
        "data), train those tokens' rows of the embedding and output head (PEFT's "
        "trainable_token_indices); every other row stays frozen"
    )


# Data, metrics, profiling, checkpoint, validation and evaluation: sections_io.py.
from torchllm.config.sections_io import (  # noqa: E402  (re-exported: one import path)
    Checkpoint, Data, DataSource, Eval, Metrics, Profiling, Validation,
)
