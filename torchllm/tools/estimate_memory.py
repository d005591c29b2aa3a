"""Analytic per-rank memory of a training step, with the phase where it peaks.

    python -m torchllm.tools.estimate_memory --job.config_file X [--section.key=value ...]
        [--world_size N] [--json] (e.g. --training.device=cuda to estimate a GPU job on a laptop)

Prints a table of the terms and phases (GiB per rank), or the numbers as JSON with --json.

Terms (bytes per rank):
  params, grads      fp32 master copies (MoE: every expert), divided by the FSDP shard degree
                     and TP (not the MoE layers: TP replicates them)
  optimizer          AdamW's two fp32 moments, sharded like the params
  ddp_buckets        DDP's flat gradient buckets, a second gradient-sized buffer
  gathered_params    FSDP2's all-gathered params in the param dtype: the root's (embedding,
                     norm, head) and the blocks kept after forward (the last one by default,
                     all with reshard_after_forward=never); in a block's backward also the
                     block and its prefetched neighbour, and two blocks' unsharded gradients
  autocast_weights   under bf16 autocast (not FSDP2): the bf16 copies of the matmul weights
                     that forward saves for backward
  activations        what autograd keeps from forward to backward, per block by AC mode
                     (compiled blocks and float8 linears keep less: activation_bytes.py)
  recompute          with AC: one block's activations, rebuilt during its backward
  logits             what the output head and loss keep for backward, by loss path
                     (loss_bytes: the bf16 logits for the fused loss, the float32 log-softmax
                     in fp32, nothing with chunked_loss; the logits when the loss is compiled)

The estimate is of allocated tensor bytes (CUDA: `max_memory_allocated`), not of what the
caching allocator reserves (`max_memory_reserved`, larger by its fragmentation). On the first
H200 run (Llama 3.2 1B shape, seq 2048, bf16 + compile, AC none, local batch 4/8/16, with and
without float8 tensorwise) measured / estimate is 1.004-1.006.

Phases: `forward` ends with every activation and the logits alive; `loss backward` adds the
logits' gradients; `optimizer` holds params, grads and moments; under FSDP2 or AC,
`block backward` holds the gathered blocks and unsharded gradients of the block being
differentiated, or the block AC rebuilds. The largest is the estimate. Parameters and FLOPs
per token come from `torchllm.metrics.flops` (the same numbers the trainer's MFU uses; MoE:
FLOPs from the parameters a token runs through, memory from all of them). MoE blocks'
activations are counted as a dense FFN of the flavor's hidden_dim: not calibrated for MoE.

Pipeline parallelism: each pp rank holds its stages' blocks (plus the embedding on the first
stage, the final norm and head on the last), and keeps activations of one micro-batch per
forward it has run but not yet differentiated (the schedule's in-flight count, see
pipeline_ranks), with the gradients of earlier micro-batches alive; the estimate is that of the
pp rank with the largest peak (measured on CPU, debug shape, 1F1B, 8 micro-batches: 0.96-0.97 of
each rank's peak).
"""

from __future__ import annotations

import json
import sys

import torch

from torchllm import models
from torchllm.config import ConfigError, load_config
from torchllm.device import resolve_device
from torchllm.metrics.flops import flops_per_token, parameter_counts
from torchllm.models.contract import LanguageModel
from torchllm.models.lora import build_with_lora
from torchllm.models.moe import MoE
from torchllm.parallel.dims import ParallelDims
from torchllm.parallel.pipeline import check_pipeline, rank_stages, stages_per_rank
from torchllm.precision import use_bf16
from torchllm.tools.activation_bytes import (FP32, activation_bytes_per_block, lora_activation_bytes,
                                             loss_bytes)
from torchllm.tools.model_info import asks_help, pop_flag, tokenizer_vocab_hint


def check_trainer_config(train_args: list[str], world_size: int):
    """The trainer's own checks of a config on `world_size` ranks (torchllm.run.launch's
    check_config less the data and tokenizer: the parallel degrees, model shape and option
    combinations of parallel/parallelize.build_parallel_dims); ConfigError in its words."""
    from torchllm.parallel import build_parallel_dims

    cfg = load_config(train_args)
    args = models.model_args(cfg, tokenizer_vocab_hint(cfg))
    device = cfg.training.device if cfg.training.device != "auto" else resolve_device("auto").type
    build_parallel_dims(cfg, world_size, device, args)
    return cfg


def moe_params(model: LanguageModel) -> dict[str, int]:
    """Parameters of each block's MoE layer (router + experts), by block name; 0 when dense."""
    return {name: sum(p.numel() for m in block.modules() if isinstance(m, MoE)
                      for p in m.parameters())
            for name, block in model.layers.items()}


def pipeline_ranks(cfg, model_args, dims: ParallelDims) -> list[dict]:
    """What each pipeline rank holds: its blocks, the embedding (first stage) and the head (last
    stage), and at most how many (micro-batch, stage) forwards it keeps for backward at once.

    The in-flight count follows the schedule (torch.distributed.pipelining): GPipe runs every
    micro-batch's forward before any backward; 1F1B's rank r runs pp - r forwards before its
    first backward; the interleaved and zero-bubble schedules warm up (v - 1) x pp + 2 x
    (pp - 1 - r) forwards over their v stages per rank (torch's warm-up count; zero-bubble's
    deferred weight gradients are not counted). Without PP: one rank, one forward, everything."""
    n_layers = model_args.n_layers
    if not dims.pp_enabled:
        return [{"pp_rank": 0, "blocks": list(range(n_layers)), "first": True, "last": True,
                 "in_flight": 1, "micro_batch": cfg.training.local_batch_size,
                 "accumulates": False}]
    pcfg = cfg.parallelism
    schedule, pp = pcfg.pipeline_parallel_schedule, dims.pp
    stages = check_pipeline(cfg, model_args, pp)
    v = stages_per_rank(schedule)
    n_micro = cfg.training.local_batch_size // pcfg.pipeline_parallel_microbatch_size
    ranks = []
    for r in range(pp):
        mine = rank_stages(schedule, pp, r)
        if schedule == "GPipe":
            pairs = n_micro
        elif v == 1:
            pairs = min(n_micro, pp - r)
        else:
            pairs = min(n_micro * v, (v - 1) * pp + 2 * (pp - 1 - r) + 1)
        blocks = [b for s in mine for b in stages[s]]
        ranks.append({"pp_rank": r, "blocks": blocks, "first": 0 in mine,
                      "last": len(stages) - 1 in mine,
                      "in_flight": pairs / len(mine),  # in units of this rank's whole blocks
                      "micro_batch": pcfg.pipeline_parallel_microbatch_size,
                      # earlier micro-batches' gradients exist while later ones run
                      "accumulates": n_micro > 1})
    return ranks


def estimate_memory(cfg, model_args, world_size: int) -> dict:
    """Per-rank bytes of each term and phase (see the module docstring); under pipeline
    parallelism, those of the pipeline rank with the largest peak (`pp_rank`)."""
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    dims.validate()
    with torch.device("meta"):  # (lora.enable: with its adapters, the base frozen)
        model = build_with_lora(models.get(cfg.model.name), model_args, cfg)
    counts = parameter_counts(model)
    tcfg = cfg.training
    # Where the run would train; "cuda" need not be present here (estimate a GPU job anywhere).
    device = tcfg.device if tcfg.device != "auto" else resolve_device("auto").type
    act = 2 if use_bf16(tcfg.mixed_precision, device) else FP32
    ranks = [rank_memory(cfg, model_args, model, dims, act, r)
             for r in pipeline_ranks(cfg, model_args, dims)]
    worst = max(ranks, key=lambda r: r["phases_bytes"][r["peak_phase"]])
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
        **counts,
        "flops_per_token": flops_per_token(model, tcfg.seq_len),
        "terms_bytes": worst["terms_bytes"],
        "phases_bytes": worst["phases_bytes"],
        "peak_phase": peak_phase,
        "peak_bytes": worst["phases_bytes"][peak_phase],
        "peak_gib": round(worst["phases_bytes"][peak_phase] / 1024**3, 3),
        "ranks": [{"pp_rank": r["pp_rank"], "terms_bytes": r["terms_bytes"],
                   "phases_bytes": r["phases_bytes"], "peak_phase": r["peak_phase"],
                   "peak_bytes": r["phases_bytes"][r["peak_phase"]]} for r in ranks],
    }


def rank_memory(cfg, model_args, model: LanguageModel, dims: ParallelDims, act: int, rank: dict) -> dict:
    """Terms and phases of one rank holding `rank` (see pipeline_ranks) of the model."""
    tcfg = cfg.training
    shard = dims.dp_shard * dims.cp * dims.tp  # FSDP2 shards over dp_shard x cp
    n_blocks = len(rank["blocks"])
    # All parameters count (every expert is stored); TP splits all but the MoE layers', which
    # it replicates (parallel/tp.py), so those are divided by the FSDP degree only.
    moe_by_block = moe_params(model)
    moe = moe_by_block["0"]
    block_params = sum(p.numel() for p in model.layers["0"].parameters())
    block_split = block_params - moe
    mine = [model.layers[str(b)] for b in rank["blocks"]]
    moe_sum = sum(moe_by_block[str(b)] for b in rank["blocks"])
    split_sum = sum(p.numel() for m in mine for p in m.parameters()) - moe_sum
    if rank["first"] and rank["last"]:  # the whole model: every parameter outside the blocks
        in_blocks = {id(p) for p in model.layers.parameters()}
        root = [p for p in model.parameters() if id(p) not in in_blocks]
    else:  # a pipeline rank: the embedding on the first stage, final norm and head on the last
        root = [p for m in [model.tok_embeddings] * rank["first"]
                + [m for m in (model.norm, model.output) if m is not None] * rank["last"]
                for p in m.parameters()]
    root_params = sum(p.numel() for p in root)

    def sharded(root_part: int, split: int, moe_part: int) -> int:
        return (root_part + split) * FP32 // shard + moe_part * FP32 // (shard // dims.tp)

    params = sharded(root_params, split_sum, moe_sum)
    # Gradients and AdamW moments exist for the parameters that train: all of them, or with
    # LoRA the adapters (and lora.train_embeddings' tables); frozen weights have neither.
    trained, grad_block = params, block_split
    if cfg.lora.enable:
        def n_trained(ps) -> int:
            return sum(p.numel() for p in ps if p.requires_grad)
        trained = sharded(n_trained(root), n_trained(p for m in mine for p in m.parameters()), 0)
        grad_block = n_trained(model.layers["0"].parameters())  # unsharded block gradients
    terms = {"params": params, "grads": trained, "optimizer": 2 * trained}
    terms["ddp_buckets"] = trained if dims.ddp_enabled else 0
    block = block_split * act // dims.tp + moe * act  # one block's gathered params
    root = root_params * act // dims.tp  # embedding, norm, head
    if dims.fsdp_enabled:
        # The root's params stay gathered from forward to backward; after forward, blocks are
        # resharded except the last (default) or none (never).
        kept = {"never": n_blocks, "always": 0}.get(cfg.parallelism.fsdp_reshard_after_forward, 1)
        terms["gathered_params"] = root + kept * block
        # In a block's backward: it and the prefetched next are gathered, and two blocks'
        # unsharded float32 gradients exist (one being computed, one being reduce-scattered).
        block_backward_extra = (max(0, 2 - kept) * block + 2 * grad_block * FP32 // dims.tp
                                + 2 * moe * FP32 * (not cfg.lora.enable))
    else:
        terms["gathered_params"] = block_backward_extra = 0

    # Tokens of one forward: the local batch, or one pipeline micro-batch; cp splits sequences.
    tokens = rank["micro_batch"] * tcfg.seq_len // dims.cp
    ac = cfg.activation_checkpoint
    autocast = act != FP32 and not dims.fsdp_enabled  # (FSDP2 runs bf16 params instead)
    spec = models.get(cfg.model.name)
    # Compiled blocks (AC none) and float8 linears (tensorwise) save less: compiled_block_bytes.
    compiled = cfg.compile.enable and "model" in cfg.compile.components and ac.mode == "none"
    float8 = compiled and cfg.float8.enable and cfg.float8.recipe == "tensorwise"
    per_block = activation_bytes_per_block(spec, model_args, tokens, act, ac.mode,
                                           ac.selective_option, autocast, compiled, float8)
    per_block += lora_activation_bytes(model, cfg, tokens, act)
    if ac.mode == "selective" and ac.selective_option.isdigit():
        every = int(ac.selective_option)
        full = activation_bytes_per_block(spec, model_args, tokens, act, "full", "")
        checkpointed = n_blocks // every
        activations = checkpointed * full + (n_blocks - checkpointed) * per_block
    else:
        activations = n_blocks * per_block
    # With AC, a block's activations are rebuilt in its backward: after the loss backward.
    recompute = 0 if ac.mode == "none" else activation_bytes_per_block(
        spec, model_args, tokens, act, "none", "", autocast)
    # The embedding output (first block's input), the final norm's x*rstd and its output.
    activations += (rank["first"] + 2 * rank["last"]) * tokens * model_args.dim * act
    activations = int(activations * rank["in_flight"])  # pipeline: forwards kept at once
    terms["activations"] = activations // dims.tp
    terms["recompute"] = recompute // dims.tp

    # The loss's tensors on the last stage: kept per forward in flight, and the transient ones of
    # the loss's forward and backward (see loss_bytes).
    compiled_loss = (cfg.compile.enable and "loss" in cfg.compile.components
                     and not tcfg.chunked_loss and not dims.pp_enabled)
    kept, loss_forward, loss_backward = loss_bytes(tcfg, act, tokens, model_args,
                                                   pipelined=dims.pp_enabled,
                                                   compiled=compiled_loss)
    logit_forwards = rank["in_flight"] if rank["last"] else 0
    terms["logits"] = int(kept * logit_forwards)
    if not rank["last"]:
        loss_forward = loss_backward = 0

    # Autocast's bf16 copies of the matmul weights, saved by forward for backward (not the
    # embedding, which is looked up, not multiplied).
    # Float8 (tensorwise, compiled) keeps no copy of the blocks' linear weights: backward casts
    # them again from the float32 masters (measured on an H200: the peak drops by their bf16 size).
    embedding = model.tok_embeddings.weight.numel() if rank["first"] else 0
    terms["autocast_weights"] = (
        (root_params - embedding * (model.output is not None)) * act // dims.tp
        + (0 if float8 else split_sum * act // dims.tp + moe_sum * act)) if autocast else 0

    state = terms["params"] + terms["optimizer"] + terms["ddp_buckets"]
    held = (terms["gathered_params"] + terms["autocast_weights"]
            + (terms["grads"] if rank["accumulates"] else 0))
    phases = {
        "forward": state + held + activations + terms["logits"] + loss_forward,
        # The loss's gradients (loss_bytes) join the forward's tensors.
        "loss backward": state + held + activations + terms["logits"] + loss_backward,
        "optimizer": state + terms["grads"],
    }
    if dims.fsdp_enabled or recompute:
        # Early in the blocks' backward (an upper bound: every gradient, every saved
        # activation): FSDP2's gathered blocks and unsharded gradients, AC's rebuilt block.
        phases["block backward"] = (state + terms["grads"] + terms["gathered_params"]
                                    + block_backward_extra + terms["activations"]
                                    + (terms["recompute"] or per_block // dims.tp))
    return {"pp_rank": rank["pp_rank"], "tokens": tokens, "terms_bytes": terms,
            "phases_bytes": phases, "peak_phase": max(phases, key=phases.get)}


def estimate_table(cfg, e: dict) -> str:
    """estimate_memory()'s result as a table (GiB per rank), the peak phase marked."""
    gib = 1024 ** 3
    layout = ", ".join(f"{k} {e[k]}" for k in ("dp_shard", "dp_replicate", "tp", "cp", "pp")
                       if e[k] > 1) or "one process"
    lines = [
        f"{cfg.model.name}/{cfg.model.flavor} on {e['world_size']} rank(s) ({layout}"
        + (f"; pp rank {e['pp_rank']}" if e["pp"] > 1 else "") + ")",
        f"  {e['params']:,} params ({e['non_embedding_params']:,} non-embedding), "
        f"{e['flops_per_token'] / 1e9:,.2f} GFLOPs/token; {e['tokens_per_rank']:,} tokens "
        f"per rank, activations {e['activation_bytes']} bytes",
        "",
        f"  {'term':<20}{'GiB/rank':>10}",
    ]
    lines += [f"  {k:<20}{v / gib:>10.2f}" for k, v in e["terms_bytes"].items() if v]
    lines += ["", f"  {'phase':<20}{'GiB/rank':>10}"]
    lines += [f"  {k:<20}{v / gib:>10.2f}" + ("  <- peak" if k == e["peak_phase"] else "")
              for k, v in e["phases_bytes"].items()]
    lines += ["", f"peak {e['peak_gib']:.2f} GiB per rank ({e['peak_phase']})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if asks_help(argv, __doc__):
        return 0
    as_json = pop_flag(argv, "--json")
    world_size = 1
    for i, a in enumerate(argv):
        if a.startswith("--world_size"):
            value = a.split("=", 1)[1] if "=" in a else argv.pop(i + 1)
            argv.pop(i)
            world_size = int(value)
            break
    try:
        cfg = load_config(argv)
        args = models.model_args(cfg, tokenizer_vocab_hint(cfg))
        result = estimate_memory(cfg, args, world_size)
        print(json.dumps(result, indent=1) if as_json else estimate_table(cfg, result))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
