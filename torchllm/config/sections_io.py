"""Typed config sections of what goes in and out of a run: data, metrics, profiling,
checkpoints, validation and evaluation (the model/training/parallelism ones are in sections.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchllm.config.fields import BELOW_ONE, NON_NEGATIVE, POSITIVE, Range, opt


@dataclass
class DataSource:
    """One weighted source of a mixture: a `[[data.sources]]` table."""

    dataset: str = opt("", "Any data.dataset value (local:, shards:, embedded, ...)")
    weight: float = opt(
        1.0, "Share of the training tokens (weights are normalized to sum 1)", POSITIVE
    )


@dataclass
class Data:
    dataset: str = opt(
        "embedded",
        "embedded (CPython's docs, no download) | fineweb_edu | fineweb_edu_100b | hf:NAME | "
        "local:PATH (.txt/.jsonl/.parquet file, glob or folder) | shards:DIR or shards:s3://B/P "
        "(from prepare)",
    )
    tokenizer: str = opt(
        "auto",
        "SentencePiece/tiktoken .model, .tiktoken, tokenizer.json, Hub name; auto = train a "
        "SentencePiece model on the corpus (shards: the one in index.json), or with "
        "checkpoint.initial_load_path the loaded model's; train = always train a new one on "
        "the corpus (a stage: a warning, its ids differ from the loaded model's); bytes = "
        "UTF-8 bytes + BOS/EOS (258 ids, nothing to train: character-level recipes); "
        "from_initial_load = the one the run at checkpoint.initial_load_path trained with",
    )
    tokenizer_vocab_size: int = opt(4096, "Vocab size when auto-training a tokenizer")
    tokenizer_train_chars: int = opt(
        50_000_000, "Characters of the corpus read when auto-training a tokenizer"
    )
    text_column: str = opt("text", "Column holding the text in .jsonl/.parquet/Hub rows")
    hf_subset: str = opt("", "Hugging Face dataset subset (config name); empty = the registry's")
    hf_split: str = opt("", "Hugging Face dataset split; empty = the registry's, else 'train'")
    val_fraction: float = opt(
        0.05, "embedded/local/chat: fraction of the tokens (the end of the corpus) held out "
        "for validation; only with validation.enable (off: every window trains)",
        BELOW_ONE,
    )
    val_documents: int = opt(
        1000, "Hugging Face streams: the first N documents are held out for validation; only "
        "with validation.enable (off: every document trains)"
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
    tb_folder: str = opt(
        "tb", "TensorBoard folder under job.dump_folder (one subfolder per run); a relative path "
        "without '..'"
    )
    rank_0_only: bool = opt(True, "Only rank 0 writes TensorBoard/W&B; false = one folder per rank")
    enable_wandb: bool = opt(False, "Also log to Weights & Biases (needs the wandb package)")
    wandb_project: str = opt("torchllm", "W&B project name")
    progress_bar: bool = opt(True, "Live progress bar with ETA when the console is a terminal")
    report: bool = opt(
        True, "At the end of the run, rank 0 writes RUN/report/report.md with plots of the "
        "TensorBoard curves (python -m torchllm.report redraws it, or compares runs)"
    )
    guard_policy: Literal["warn", "skip_step", "stop"] = opt(
        "skip_step", "On a non-finite loss/grad norm or a loss spike: warn, drop the update, or stop"
    )
    loss_spike_factor: float = opt(
        3.0, "A loss above this multiple of its running mean is a spike; 0 disables the check",
        Range(lo=1, lo_open=True, also=(0.0,), text="0 (off) or > 1 and finite"),
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
    folder: str = opt(
        "checkpoint", "Subfolder of the run folder that holds step-<N> checkpoints (a relative "
        "path without '..'), or an object-store URL used as is (s3://bucket/prefix, gs://...; "
        "credentials from the store's environment; not file:// or another URL naming local "
        "files; docs/checkpointing.md). Only this run's steps: a folder holding another run's "
        "is refused"
    )
    local_mirror: str = opt(
        "", "With a URL checkpoint.folder: write each step to this subfolder of the run folder "
        "first, then upload it in the background (marker last); '' = write to the URL directly"
    )
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
        "", "Checkpoint (run, folder or step dir; a path or an fsspec URL) to start from when "
        "the run has none of its own"
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
        "stop", "A failed save (disk full, I/O error, an object store that fails or does not "
        "answer): stop the run (exit 4), or continue and retry at the next interval"
    )
    store_timeout_s: float = opt(
        60.0, "Object storage (s3://): seconds one request attempt may wait to connect or for "
        "an answer; s3fs tries 5 times, then the save fails (checkpoint.on_save_error)", POSITIVE
    )
    optimizer_hparams_from: Literal["checkpoint", "config"] = opt(
        "checkpoint", "On resume, peak LR/betas/eps/weight decay: the checkpoint's, or this "
        "config's (the LR schedule continues at the resumed step)"
    )
    allow_global_batch_change: bool = opt(
        False, "Allow resuming with another global batch size than the checkpoint's"
    )
    on_data_change: Literal["error", "restart"] = opt(
        "error", "On resume, when the data differs from the checkpoint's (sources, weights, "
        "tokens, seq_len, seed, tokenizer): refuse, or read the new data from its beginning "
        "(position reset; step and token counters kept)"
    )


@dataclass
class Validation:
    enable: bool = opt(False, "Compute the validation loss during training")
    freq: int = opt(250, "Validate every N steps (and after the last step)")
    steps: int = opt(
        10, "Global batches per validation of a held-out split: its first steps x global batch "
        "windows (all if fewer), the same ones whatever the number of ranks; a dedicated "
        "validation.dataset is sized by validation.max_tokens instead"
    )
    dataset: str = opt(
        "", "A dedicated validation dataset (same forms as data.dataset), read whole and scored "
        "on validation.max_tokens' windows spread evenly over it (nothing is then held out of "
        "data.dataset; TensorBoard tags val/<name>/loss); empty = the held-out split of "
        "data.dataset"
    )
    max_tokens: int = opt(
        0, "validation.dataset: score N tokens' windows, spread evenly over the whole set (all "
        "of it when smaller; a hf: stream: its first N tokens); 0 = auto: as many as cost ~5% "
        "of the run's compute (the run header says how many of how many)"
    )
    split: str = opt(
        "", "Hugging Face split to validate on (e.g. validation); empty = held out from training"
    )
    stop_at_loss: float = opt(
        0.0, "Stop the run (final save and report, as at its last step) after the first "
        "validation at or below this loss; 0 = off (needs validation.enable)", NON_NEGATIVE,
    )


@dataclass
class Eval:
    sample_freq: int = opt(0, "Complete eval.prompts every N steps during training; 0 = off")
    prompts: list[str] = opt(["The meaning of life is"], "Prompts completed during training")
    max_new_tokens: int = opt(32, "Tokens generated per prompt")
    temperature: float = opt(0.8, "Sampling temperature; 0 = greedy (argmax)", NON_NEGATIVE)
    top_k: int = opt(50, "Sample among the k most likely tokens; 0 = no limit")
    top_p: float = opt(
        1.0, "Sample from the smallest set of tokens with this total probability",
        Range(0, 1, lo_open=True),
    )
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
