"""The run header: the few lines printed at start instead of the whole config.

    run debug_model: Llama 3 debug model on the embedded corpus
      config    train_configs/debug_model.toml (full config: outputs/debug_model/config.toml)
      changed   training: steps=300 seq_len=256 ... (every key that differs from its default)
      model     llama3/debug (4 layers x 256 dim, 8 heads (4 kv) of 32, ffn 768): 5,245,184 params (4,196,608 non-embedding), vocab 4096 (tokenizer 4096)
      parallel  1 process on cpu: no data/tensor parallelism | fp32 | compile off | AC none
      batch     global batch 8 seqs x 256 tokens = 8 local x 1 dp x 1 accumulation; 2,048 tokens/step
      data      embedded: 361 documents, 131,072 tokens; 485 windows of 257 tokens per epoch; ...
      tokenizer SentencePiece outputs/debug_model/data/tokenizer_embedded_sp4096.model (4096 tokens)

Everything here is read from the run's TrainContext (torchllm.callbacks; duck-typed, so this
module imports nothing above config/ at import time); the data line is what the training batches and
the validation windows say of themselves (`describe()`), and which data specs read the Hub is
asked of the data sources' registry, the one place that knows the sources.
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from torchllm.config.job_config import JobConfig

if TYPE_CHECKING:
    from torchllm.parallel.plan import ParallelPlan

WIDTH = 100
SHOWN_ELSEWHERE = {("job", "config_file"), ("job", "description")}


HF_ONLY = {("data", "hf_subset"), ("data", "hf_split")}  # meaningless without an HF source


def _uses_hf(dcfg, vcfg) -> bool:
    """Whether any data spec of the [data] and [validation] sections reads a Hugging Face
    dataset ('hf:...', 'chat:hf:...', a named one, or a spec the sources do not know: shown
    rather than hidden)."""
    from torchllm.data.sources import reads_hub

    specs = [dcfg.dataset, vcfg.dataset, *(s.dataset for s in dcfg.sources)]
    return any(reads_hub(spec) for spec in filter(None, specs))


def config_changes(cfg: JobConfig) -> dict[str, list[str]]:
    """{section: ["key=value", ...]} for every value that differs from the dataclass default
    (data.hf_subset / hf_split only where some data source is a Hugging Face dataset)."""
    defaults = JobConfig()
    skip = SHOWN_ELSEWHERE | (set() if _uses_hf(cfg.data, cfg.validation) else HF_ONLY)
    out: dict[str, list[str]] = {}
    for name, section in cfg.sections():
        default = getattr(defaults, name)
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            # (a family's own key, absent from the default family's [model]: unset = None)
            if (name, f.name) in skip or value == getattr(default, f.name, None):
                continue
            out.setdefault(name, []).append(f"{f.name}={_short(value)}")
    return out


def _short(value) -> str:
    if isinstance(value, list) and value and all(hasattr(v, "weight") for v in value):
        # data.sources: every source in full, "spec x weight" (no dataclass repr)
        return "[" + ", ".join(f"{v.dataset} x{v.weight:g}" for v in value) + "]"
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def tokenizer_summary(tokenizer) -> str:
    kind = {"SentencePieceTokenizer": "SentencePiece", "TiktokenTokenizer": "tiktoken",
            "HFTokenizer": "tokenizers"}.get(type(tokenizer).__name__, type(tokenizer).__name__)
    where = getattr(tokenizer, "path", None)
    return f"{kind} {where} ({tokenizer.vocab_size} tokens)" if where else \
        f"{kind} ({tokenizer.vocab_size} tokens)"


def data_summary(train_dataset, val_dataset, global_batch: int, steps: int,
                 validation: bool = True) -> str:
    """Documents, tokens, windows per epoch and the epochs the run will make (per source for a
    mixture), as the training batches describe themselves; then the held-out validation part
    when `validation` is on and the windows name one; with it off, that nothing is held out
    (data.val_fraction and val_documents apply only with validation on:
    torchllm.data.holds_out)."""
    text = train_dataset.describe(global_batch, steps)
    held_out = (val_dataset.describe() if validation else
                "validation off: nothing held out (data.val_fraction unused)")
    return f"{text} | {held_out}" if held_out else text


MANY_EPOCHS = 100  # more passes over the same windows than this: the run memorizes them


def data_warnings(dcfg, vcfg, held_out: bool, train_dataset, val_dataset, global_batch: int,
                  steps: int) -> list[str]:
    """What the header's data line implies and a user should hear of: a source the run reads
    more than MANY_EPOCHS times (a small file packed into a few windows), and a held-out
    validation split of 0 windows (data.val_fraction of too few windows). `dcfg`, `vcfg`: the
    [data] and [validation] sections; `held_out`: whether the training data holds a validation
    split out (torchllm.data.holds_out)."""
    out = []
    names = getattr(train_dataset, "names", None)
    if names is not None:  # a mixture, or one source as a mixture of one (e.g. chat:)
        parts = zip(names, train_dataset.weights, train_dataset.sources)
        sizes = [(name, float(w), getattr(src, "windows_per_epoch", None))
                 for name, w, src in parts if not getattr(src, "sequential", False)]
    elif hasattr(train_dataset, "stream"):
        sizes = [(train_dataset.name, 1.0,
                  train_dataset.stream.num_windows(train_dataset.window))]
    else:
        sizes = []
    for name, weight, windows in sizes:
        if not windows:  # a Hub stream: its size unknown until read
            continue
        epochs = steps * global_batch * weight / windows
        if epochs > MANY_EPOCHS:
            out.append(
                f"{name}: {windows:,} training window{'s' if windows != 1 else ''} read "
                f"{epochs:,.0f} times ({steps:,} steps x {global_batch} windows): the model will "
                "memorize them; give more data, fewer training.steps, or for conversations "
                "data.chat_packing = 'pad' (one conversation per window)")
    held = getattr(val_dataset, "__len__", None)
    if (held is not None and len(val_dataset) == 0 and dcfg.val_fraction > 0
            and held_out and not vcfg.split):
        out.append(
            f"the held-out validation split is 0 windows (data.val_fraction = "
            f"{dcfg.val_fraction:g} of too few windows): there is nothing to validate on; "
            "give more data or a larger data.val_fraction (at least one window)")
    return out


def parallel_summary(dims, device, precision: str, plan: ParallelPlan) -> str:
    """Processes, the parallel layout (PP, data, CP, TP, EP), precision, compile and AC in one
    line; `plan`: the run's torchllm.parallel.plan.ParallelPlan (its [parallelism], [float8],
    [activation_checkpoint] and [compile] sections)."""
    world = dims.world_size
    head = f"{world} process{'es' if world > 1 else ''} on {device}"
    if dims.fsdp_enabled and dims.dp_replicate_enabled:
        layout = f"HSDP replicate {dims.dp_replicate} x shard {dims.dp_shard}"
    elif dims.fsdp_enabled:
        layout = f"FSDP2 shard {dims.dp_shard}"
    elif dims.ddp_enabled:
        layout = f"DDP {dims.dp_replicate}"
    else:
        layout = "no data parallelism"
    if dims.pp_enabled:
        pcfg = plan.parallelism
        layout = (f"PP {dims.pp} ({pcfg.pipeline_parallel_schedule}, micro-batches of "
                  f"{pcfg.pipeline_parallel_microbatch_size}) x {layout}")
    for name, degree in (("CP", dims.cp), ("TP", dims.tp), ("EP", dims.ep)):
        if degree > 1:
            layout += f", {name} {degree}"
    compiled = "compile " + ("on" if plan.compile.enable else "off")
    float8 = f" | float8 {plan.float8.recipe}" if plan.float8.enable else ""
    return (f"{head}: {layout} | {precision}{float8} | {compiled} | "
            f"AC {plan.activation_checkpoint.mode}")


def run_header(job, changes: dict[str, list[str]], *, run_dir: Path, model_line: str,
               parallel_line: str, batch_line: str, data_line: str, tokenizer_line: str) -> str:
    """The header as one multi-line string (the first line is the run's name): `job`, the [job]
    section (description, config file); `changes`, what config_changes lists."""
    title = f"run {run_dir.name}" + (f": {job.description}" if job.description else "")
    source = job.config_file or "defaults (no job.config_file)"
    changed = [("changed" if i == 0 else "", f"{section}: {' '.join(items)}")
               for i, (section, items) in enumerate(changes.items())]
    rows = [
        ("config", f"{source} (full config: {run_dir / 'config.toml'})"),
        *(changed or [("changed", "nothing: every key has its default value")]),
        ("model", model_line),
        ("parallel", parallel_line),
        ("batch", batch_line),
        ("data", data_line),
        ("tokenizer", tokenizer_line),
    ]
    lines = [title]
    for label, text in rows:
        wrapped = textwrap.wrap(text, WIDTH - 12, break_on_hyphens=False,
                                break_long_words=False) or [""]
        lines.append(f"  {label:<10}{wrapped[0]}")
        lines.extend(f"  {'':<10}{more}" for more in wrapped[1:])
    return "\n".join(lines)


def active_params(counts: dict[str, int]) -> str:
    """MoE models: ", N active per token" (top-k of the experts; FLOPs/MFU count these)."""
    if "active_params" not in counts:
        return ""
    return f", {counts['active_params']:,} active per token"


def model_shape(args) -> str:
    """The model's shape from its args (after the [model] overrides), e.g. "4 layers x 128 dim,
    4 heads (4 kv) of 32, ffn 512"."""
    return (f"{args.n_layers} layers x {args.dim} dim, {args.n_heads} heads "
            f"({args.n_kv_heads} kv) of {args.head_dim}, ffn {args.ffn_hidden_dim}")


def context_header(ctx, counts: dict[str, int]) -> str:
    """The header of a built run, from its TrainContext (its config, model, loaders, layout)."""
    from torchllm.models.lora import parameter_summary  # (LoRA: how many parameters train)

    cfg, tcfg = ctx.cfg, ctx.cfg.training
    dims = ctx.parallel_dims
    return run_header(
        cfg.job, config_changes(cfg), run_dir=ctx.run_dir,
        model_line=(f"{cfg.model.name}/{cfg.model.flavor} ({model_shape(ctx.model_args)}): "
                    f"{counts['params']:,} params "
                    f"({counts['non_embedding_params']:,} non-embedding{active_params(counts)}), "
                    "vocab "
                    f"{ctx.model_args.vocab_size} (tokenizer {ctx.tokenizer.vocab_size})"
                    f"{parameter_summary(ctx.module.model, cfg.lora, cfg.model.name)}"),
        parallel_line=parallel_summary(dims, ctx.device, ctx.module.precision_name(),
                                       ctx.module.plan),  # the plan the model was built with
        batch_line=(f"global batch {ctx.global_batch} seqs x {tcfg.seq_len} tokens = "
                    f"{tcfg.local_batch_size} local x {dims.dp_degree} dp x "
                    f"{ctx.grad_accum_steps} accumulation; {tcfg.steps:,} steps"),
        # validation: the set(s) as a validation scores them (eval.in_training.HeldOutBatches)
        data_line=data_summary(ctx.train_loader.dataset,
                               ctx.val_batches or ctx.val_loader.dataset,
                               ctx.global_batch, tcfg.steps,
                               validation=cfg.validation.enable),
        tokenizer_line=tokenizer_summary(ctx.tokenizer),
    )
