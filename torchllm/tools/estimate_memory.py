"""Analytic per-rank memory of a training step, with the phase where it peaks: size a cluster.

    python -m torchllm.tools.estimate_memory --job.config_file X [--section.key=value ...]
        [--world_size N] [--gpu_gib 80] [--moe_imbalance 2] [--json]
    (--training.device=cuda to estimate a GPU job on a laptop: training.device = auto takes
    this host's device, and a CPU host estimates float32 activations)

Prints what it assumed (the vocabulary and where it came from, the device and dtypes, the loss
path, the AC policy, FSDP2's reshard and gradient policy, micro-batches in flight, the
accumulation), the terms of the peak phase (they add up to the peak), every phase's total and
the reserved figure; --json prints one object (`peak_gib`, `reserved_gib`: the largest over the
ranks; `ranks`: each pipeline rank's terms and phases). With --gpu_gib, the verdict: fits when
the reserved figure is at most that, else exit 1. A setting the trainer refuses is refused here
in its words (exit 2): the trainer's own check (parallel/parallelize.build_parallel_dims).

Terms (bytes per rank; torchllm/tools/memory_phases.py lists the phases):
  params             fp32 master copies (MoE: every expert), divided by the FSDP2 shard degree
                     (dp_shard x cp) and TP (not the MoE layers: TP replicates them)
  optimizer          the optimizer's state as its OptimizerSpec declares it (state_bytes: AdamW
                     8 bytes per element, adamw8bit ~2, Muon 4 for the blocks' matrices),
                     sharded like the params
  grads              fp32, sharded like the params; in the blocks' backward those computed so
                     far; with accumulation `accumulated_grads` all the time
  ddp_buckets        DDP's flat gradient buckets, a second gradient-sized buffer
  gathered_params    FSDP2's all-gathered params in the param dtype: the root's (embedding,
                     norm, head) and the blocks kept after forward (the last one by default,
                     all with reshard_after_forward=never); in a block's backward also the
                     prefetched block and the block's unsharded gradients
  autocast_weights   under bf16 autocast (not FSDP2): the bf16 copies of the matmul weights
                     that forward saves for backward
  activations        what autograd keeps from forward to backward, per block by AC mode
                     (compiled blocks and float8 linears keep less: activation_bytes.py)
  recompute          with AC: what a block's backward rebuilds beyond what it saved
  backward_workspace the gradients flowing through a block's backward
  logits, loss_*     what the output head and loss keep for backward and their scratch, by
                     loss path (loss_bytes; TP: 1/tp of the logits, vocab-parallel)
  head_grads         the head's gradients, alive through the blocks' backward

The estimate is of allocated tensor bytes (CUDA: `max_memory_allocated`); `reserved` adds the
caching allocator's margin (RESERVED_MARGIN, 10%). The first H200 run recorded allocated
peaks only (../shared/gpu/2026-11-26_h200: no `max_memory_reserved`), so the margin is not
calibrated: it is an assumed headroom, said in the output, until a GPU run's
`cuda_max_reserved_bytes` (benchlib/worker.py records it) replaces it. On that run (Llama 3.2 1B shape, seq
2048, bf16 + compile, AC none, local batch 4/8/16, with and without float8 tensorwise) the
allocated estimate is within 15% of the measured peaks
(tests/unit/tools/test_estimate_memory_cuda.py). On CPU, `python benchmarks/bench_memory.py`
measures every layout's ranks against it (docs/performance.md).

Parameters and FLOPs per token come from `torchllm.metrics.flops` (the same numbers the
trainer's MFU uses; MoE: FLOPs from the parameters a token runs through, memory from all of
them). MoE blocks' activations are counted for the worst rank under a stated routing
imbalance (--moe_imbalance, default MOE_IMBALANCE = 2: the busiest expert gets twice the
balanced load, and every expert of the rank is assumed that busy; the CPU path pads each to
that capacity): a fresh router without the auxiliary loss routes that unevenly (the bench's ep2
row: 0.7-3.5x per layer), a trained, balanced one less (--moe_imbalance 1: perfectly even).

Pipeline parallelism: each pp rank holds its stages' blocks (plus the embedding on the first
stage, the final norm and head on the last), and keeps activations of one micro-batch per
forward it has run but not yet differentiated (the schedule's in-flight count, see
pipeline_ranks), with the gradients of earlier micro-batches alive.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from torchllm import models, optim
from torchllm.config import ConfigError, load_config
from torchllm.device import resolve_device
from torchllm.metrics.flops import flops_per_token, parameter_counts
from torchllm.models.lora import build_with_lora
from torchllm.optim.spec import adamw_state_bytes
from torchllm.parallel.dims import ParallelDims  # noqa: F401  (tests build dims through here)
from torchllm.parallel.plan import ParallelPlan
from torchllm.precision import use_bf16
from torchllm.tools.activation_bytes import FP32
from torchllm.tools.memory_phases import (MOE_IMBALANCE, moe_params,  # noqa: F401
                                          pipeline_ranks, rank_memory)
from torchllm.tools.model_info import asks_help, pop_flag, tokenizer_vocab_hint

GiB = 1024 ** 3
# The caching allocator reserves more than the tensors it holds (rounded blocks, pools per
# stream, fragmentation): reserved ~ allocated x (1 + RESERVED_MARGIN). See the module docstring.
RESERVED_MARGIN = 0.10


def check_trainer_config(train_args: list[str], world_size: int, target_device: str | None = None):
    """The trainer's own checks of a config on `world_size` ranks (those of
    torchllm.run.launch.check_config that need no data or tokenizer: the parallel degrees, the
    model shape, option combinations; parallel/parallelize.build_parallel_dims); ConfigError in
    the trainer's words. Returns the config."""
    cfg = load_config(train_args)
    _checked(cfg.model, cfg.training, cfg.data, cfg.optimizer, world_size,
             target(cfg.training, target_device)[0], parallelism=cfg.parallelism,
             eval=cfg.eval, float8=cfg.float8, activation_checkpoint=cfg.activation_checkpoint,
             lora=cfg.lora, compile=cfg.compile)
    return cfg


def target(tcfg, target_device: str | None = None) -> tuple[str, str]:
    """(the device type the run would train on, where that comes from): `target_device`, else
    the [training] section's device ("auto": this host's); "cuda" need not be present here
    (estimate a GPU job anywhere)."""
    if target_device or tcfg.device != "auto":
        return target_device or tcfg.device, "training.device"
    return resolve_device("auto").type, "training.device = auto: this host's"


def _checked(mcfg, tcfg, dcfg, ocfg, world_size: int, device: str, *, parallelism, eval, float8,
             activation_checkpoint, lora, compile):
    """The ParallelDims of the run on `world_size` ranks of `device` after the trainer's checks:
    the model's args ([model] `mcfg`, [training] `tcfg`, [data] `dcfg`), a registered optimizer
    ([optimizer] `ocfg`), the layout (build_parallel_dims, its sections)."""
    from torchllm.parallel import build_parallel_dims

    args = models.model_args(mcfg, tcfg, dcfg, tokenizer_vocab_hint(dcfg))
    optim.get(ocfg.name)  # a registered optimizer
    if device == "cuda" and float8.enable and not torch.cuda.is_available():
        # float8's hardware check is about the cluster's GPUs, not this host (as dry_run)
        float8 = dataclasses.replace(float8, emulate=True)
    return build_parallel_dims(world_size, device, args, parallelism=parallelism, model=mcfg,
                               training=tcfg, data=dcfg, eval=eval, float8=float8,
                               activation_checkpoint=activation_checkpoint, lora=lora,
                               compile=compile)


def vocab_source(mcfg, dcfg, model_args) -> str:
    """Where the estimate's vocabulary comes from, in words ([model] `mcfg`, [data] `dcfg`)."""
    v = f"{model_args.vocab_size:,}"
    if mcfg.vocab_size:
        return f"{v} (model.vocab_size)"
    if tokenizer_vocab_hint(dcfg) is not None:
        return (f"{v} (the tokenizer data.tokenizer = {dcfg.tokenizer!r} trains: "
                f"data.tokenizer_vocab_size; set model.vocab_size for a real tokenizer's)")
    return (f"{v} (flavor {mcfg.flavor}'s; the run takes its tokenizer's, "
            f"{dcfg.tokenizer}: set model.vocab_size if they differ)")


def loss_path(tcfg, ccfg, dims, act: int) -> str:
    """The loss the run computes, in words ([training] `tcfg`, [compile] `ccfg`)."""
    if tcfg.chunked_loss:
        return f"chunked (training.chunked_loss, {tcfg.loss_chunk_tokens} tokens a chunk)"
    if dims.tp > 1:
        return f"vocab-parallel cross entropy (logits split over tp {dims.tp})"
    if ccfg.enable and "loss" in ccfg.components and not dims.pp_enabled:
        return "compiled cross entropy (compile.components has loss)"
    return "fused cross entropy over bf16 logits" if act != FP32 else \
        "float32 logits and log-softmax"


def assumptions(plan: ParallelPlan, optimizer: str, moe: bool, vocabulary: str, loss: str,
                dims, device: str, device_from: str, act: int, accum: int, ranks: list[dict],
                declared: bool, moe_imbalance: float = MOE_IMBALANCE) -> dict[str, str]:
    """What the estimate assumed, in words (printed above the table, in --json): the layout's
    `plan`, the optimizer's name, whether the model routes to experts (`moe`), where the
    vocabulary came from and the loss path (vocab_source's and loss_path's words)."""
    pcfg, ac = plan.parallelism, plan.activation_checkpoint
    out = {
        "vocabulary": vocabulary,
        "device": f"{device} ({device_from})",
        "dtypes": ("float32 master params, grads and optimizer state; activations "
                   + ("bf16" if act == 2 else "float32")
                   + (" (training.mixed_precision on cuda)" if act == 2 else "")),
        "loss": loss,
        "activation checkpointing": ac.mode + (f" ({ac.selective_option})"
                                               if ac.mode == "selective" else ""),
        "optimizer": f"{optimizer}: " + ("its declared state bytes per parameter"
                                                  if declared else "state not declared by its "
                                                  "OptimizerSpec: AdamW's 8 bytes per parameter "
                                                  "assumed"),
        "accumulation": f"{accum} micro-step(s) per optimizer step",
        "micro-batches in flight": ", ".join(f"pp rank {r['pp_rank']}: {r['in_flight']:g}"
                                             for r in ranks) if dims.pp_enabled else "1",
    }
    if moe:
        out["MoE routing"] = (
            f"the busiest expert at {moe_imbalance:g}x the balanced load, every expert of the "
            f"rank that busy (the worst rank; --moe_imbalance; 1 = perfectly balanced); "
            f"expert parallel {dims.ep}; " + ("each expert padded to that capacity (the CPU "
                                               "path)" if act == FP32 else
                                               "grouped matmuls over the rows received"))
    if dims.fsdp_enabled:
        out["reshard"] = (f"fsdp_reshard_after_forward = {pcfg.fsdp_reshard_after_forward}; "
                          + ("gradients reduce-scattered every micro-step"
                             if getattr(pcfg, "fsdp_reduce_every_microstep", False)
                             else "unsharded gradients kept until the last micro-step"))
    out["reserved"] = (f"the caching allocator's reserve: allocated x {1 + RESERVED_MARGIN:g} "
                       "(uncalibrated on a GPU: see estimate_memory's docstring)")
    return out


def accumulation_steps(tcfg, dims) -> int:
    """Micro-steps per optimizer step of the [training] section `tcfg` on `dims`."""
    per_pass = tcfg.local_batch_size * dims.dp_degree
    if tcfg.global_batch_size in (-1, 0) or tcfg.global_batch_size % per_pass:
        return 1
    return max(1, tcfg.global_batch_size // per_pass)


def estimate_memory(cfg, model_args, world_size: int, target_device: str | None = None,
                    moe_imbalance: float = MOE_IMBALANCE) -> dict:
    """Per-rank bytes of each term and phase (see the module docstring) of the run the whole
    config `cfg` describes (an entry point: each piece below gets its sections); under pipeline
    parallelism, those of the pipeline rank with the largest peak (`pp_rank`), each pipeline
    rank's in `ranks`. Refuses (ConfigError, the trainer's words) what the trainer refuses.
    `moe_imbalance`: the busiest expert's load over the balanced one (MoE models)."""
    tcfg = cfg.training
    device, device_from = target(tcfg, target_device)  # where the run would train
    dims = _checked(cfg.model, tcfg, cfg.data, cfg.optimizer, world_size, device,
                    parallelism=cfg.parallelism, eval=cfg.eval, float8=cfg.float8,
                    activation_checkpoint=cfg.activation_checkpoint, lora=cfg.lora,
                    compile=cfg.compile)
    with torch.device("meta"):  # (lora.enable: with its adapters, the base frozen)
        model = build_with_lora(models.get(cfg.model.name), model_args, cfg.lora, cfg.model,
                                cfg.float8.enable)
    counts = parameter_counts(model)
    act = 2 if use_bf16(tcfg.mixed_precision, device) else FP32
    spec = optim.get(cfg.optimizer.name)
    state_bytes = spec.state_bytes or adamw_state_bytes
    accum = accumulation_steps(tcfg, dims)
    layout = pipeline_ranks(cfg.parallelism, tcfg, cfg.model.name, cfg.eval, model_args, dims)
    plan = ParallelPlan.of(parallelism=cfg.parallelism, float8=cfg.float8,
                           activation_checkpoint=cfg.activation_checkpoint, compile=cfg.compile,
                           training=tcfg)
    ranks = [rank_memory(plan, tcfg, cfg.lora, cfg.model.name, model_args, model, dims, act, r,
                         state_bytes, accum, moe_imbalance) for r in layout]
    for r in ranks:
        r["peak_bytes"] = r["phases_bytes"][r["peak_phase"]]
        r["reserved_bytes"] = int(r["peak_bytes"] * (1 + RESERVED_MARGIN))
    worst = max(ranks, key=lambda r: r["peak_bytes"])
    peak_phase = worst["peak_phase"]
    return {
        "world_size": world_size,
        "dp_shard": dims.dp_shard,
        "dp_replicate": dims.dp_replicate,
        "tp": dims.tp,
        "cp": dims.cp,
        "pp": dims.pp,
        "pp_rank": worst["pp_rank"],
        "tokens_per_rank": worst["tokens"],
        "activation_bytes": act,
        "vocab_size": model_args.vocab_size,
        "assumptions": assumptions(
            plan, cfg.optimizer.name, bool(models.get(cfg.model.name).n_experts(model_args)),
            vocab_source(cfg.model, cfg.data, model_args), loss_path(tcfg, cfg.compile, dims, act),
            dims, device, device_from, act, accum, layout, spec.state_bytes is not None,
            moe_imbalance),
        **counts,
        "flops_per_token": flops_per_token(model, tcfg.seq_len),
        "terms_bytes": worst["terms_bytes"],
        "phases_bytes": worst["phases_bytes"],
        "peak_phase": peak_phase,
        "peak_terms_bytes": worst["phases"][peak_phase],
        "peak_bytes": worst["peak_bytes"],
        "peak_gib": round(worst["peak_bytes"] / GiB, 3),
        "reserved_bytes": worst["reserved_bytes"],
        "reserved_gib": round(worst["reserved_bytes"] / GiB, 3),
        "ranks": [{k: r[k] for k in ("pp_rank", "tokens", "terms_bytes", "phases", "phases_bytes",
                                     "peak_phase", "peak_bytes", "reserved_bytes")}
                  for r in ranks],
    }


def levers(ac, tcfg, e: dict) -> list[str]:
    """What would lower the peak, among the settings not already at their most frugal
    ([activation_checkpoint] `ac`, [training] `tcfg`)."""
    out = ["lower training.local_batch_size"]
    if ac.mode == "none":
        out.append("turn on activation_checkpoint.mode (selective or full)")
    elif ac.mode == "selective":
        out.append("activation_checkpoint.mode = full")
    out.append("raise the shard, TP or PP degree")
    if not tcfg.chunked_loss and e["tp"] == 1:
        out.append("use training.chunked_loss")
    return out


def verdict(e: dict, gpu_gib: float, left: list[str] | None = None) -> tuple[bool, str]:
    """(fits, a line saying so): the reserved figure (peak + the allocator's margin) against
    `gpu_gib` of device memory; when it does not fit, the levers `left` (levers())."""
    fits = e["reserved_gib"] <= gpu_gib
    line = (f"{'fits' if fits else 'DOES NOT FIT'}: peak {e['peak_gib']:.2f} GiB allocated, "
            f"~{e['reserved_gib']:.2f} GiB reserved per rank (+{RESERVED_MARGIN:.0%} allocator "
            f"margin) vs --gpu_gib {gpu_gib:g}")
    if not fits and left:
        line += "; " + ", ".join(left)
    return fits, line


def estimate_table(mcfg, e: dict) -> str:
    """estimate_memory()'s result as text (GiB per rank) for the [model] section `mcfg`: the
    assumptions, the peak phase's terms (they add up to the peak), every phase's total, the
    reserved figure."""
    layout = ", ".join(f"{k} {e[k]}" for k in ("dp_shard", "dp_replicate", "tp", "cp", "pp")
                       if e[k] > 1) or "one process"
    lines = [
        f"{mcfg.name}/{mcfg.flavor} on {e['world_size']} rank(s) ({layout}"
        + (f"; pp rank {e['pp_rank']}" if e["pp"] > 1 else "") + ")",
        f"  {e['params']:,} params ({e['non_embedding_params']:,} non-embedding), "
        f"{e['flops_per_token'] / 1e9:,.2f} GFLOPs/token; {e['tokens_per_rank']:,} tokens "
        f"per rank",
        "", "assumed:",
    ]
    lines += [f"  {k:<26}{v}" for k, v in e["assumptions"].items()]
    lines += ["", f"  {'peak phase: ' + e['peak_phase']:<32}{'GiB/rank':>10}"]
    lines += [f"  {k:<32}{v / GiB:>10.3f}" for k, v in e["peak_terms_bytes"].items()]
    lines += [f"  {'= peak (allocated)':<32}{e['peak_bytes'] / GiB:>10.3f}"]
    lines += ["", f"  {'phase':<32}{'GiB/rank':>10}"]
    lines += [f"  {k:<32}{v / GiB:>10.3f}" + ("  <- peak" if k == e["peak_phase"] else "")
              for k, v in e["phases_bytes"].items()]
    lines += ["", f"peak {e['peak_gib']:.2f} GiB per rank ({e['peak_phase']}), "
              f"reserved ~{e['reserved_gib']:.2f} GiB"]
    return "\n".join(lines)


def _pop_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag or a.startswith(flag + "="):
            value = a.split("=", 1)[1] if "=" in a else argv.pop(i + 1)
            argv.pop(i)
            return value
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if asks_help(argv, __doc__):
        return 0
    as_json = pop_flag(argv, "--json")
    try:
        world_size = int(_pop_value(argv, "--world_size") or 1)
        gpu = _pop_value(argv, "--gpu_gib")
        gpu_gib = None if gpu is None else float(gpu)
        imbalance = float(_pop_value(argv, "--moe_imbalance") or MOE_IMBALANCE)
    except ValueError as e:
        print(f"config error: --world_size / --gpu_gib / --moe_imbalance must be numbers ({e})",
              file=sys.stderr)
        return 2
    if not imbalance >= 1:
        print(f"config error: --moe_imbalance {imbalance:g}: the busiest expert's load over the "
              "balanced one, at least 1", file=sys.stderr)
        return 2
    try:
        cfg = load_config(argv)
        args = models.model_args(cfg.model, cfg.training, cfg.data,
                                 tokenizer_vocab_hint(cfg.data))
        result = estimate_memory(cfg, args, world_size, moe_imbalance=imbalance)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    fits = True
    if gpu_gib is not None:
        fits, line = verdict(result, gpu_gib,
                             levers(cfg.activation_checkpoint, cfg.training, result))
        result["gpu_gib"], result["fits"] = gpu_gib, fits
    print(json.dumps(result, indent=1) if as_json else estimate_table(cfg.model, result))
    if gpu_gib is not None and not as_json:
        print(line)
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
