"""Analytic per-rank memory of a training step, with the phase where it peaks.

    python -m torchllm.tools.estimate_memory --job.config_file X [--section.key=value ...]
        [--world_size N]          (e.g. --training.device=cuda to estimate a GPU job on a laptop)

Terms (bytes per rank):
  params, grads      fp32 master copies (MoE: every expert), divided by the FSDP shard degree
                     and TP (not the MoE layers: TP replicates them)
  optimizer          AdamW's two fp32 moments, sharded like the params
  ddp_buckets        DDP's flat gradient buckets, a second gradient-sized buffer
  gathered_params    FSDP2's all-gathered params in the param dtype: the root's (embedding,
                     norm, head) and the blocks kept after forward (the last one by default,
                     all with reshard_after_forward=never); in a block's backward also the
                     block and its prefetched neighbour, and two blocks' unsharded gradients
  activations        what autograd keeps from forward to backward, per block by AC mode
  recompute          with AC: one block's activations, rebuilt during its backward
  logits             the output head's vocab x tokens and the float32 log-softmax kept for
                     backward; under bf16 also the float32 upcast the loss makes (transient)

Phases: `forward` ends with every activation and the logits alive; `loss backward` adds the
logits' gradients; `optimizer` holds params, grads and moments; under FSDP2 or AC,
`block backward` holds the gathered blocks and unsharded gradients of the block being
differentiated, or the block AC rebuilds. The largest is the estimate. Parameters and FLOPs
per token come from `torchllm.metrics.flops` (the same numbers the trainer's MFU uses; MoE:
FLOPs from the parameters a token runs through, memory from all of them). MoE blocks'
activations are counted as a dense FFN of the flavor's hidden_dim: not calibrated for MoE.
"""

from __future__ import annotations

import json
import sys

import torch

from torchllm import models
from torchllm.config import ConfigError, load_config
from torchllm.device import resolve_device
from torchllm.metrics.flops import flops_per_token, parameter_counts
from torchllm.models.moe import MoE
from torchllm.parallel.dims import ParallelDims
from torchllm.precision import use_bf16
from torchllm.tools.model_info import tokenizer_vocab_hint

FP32 = 4


def activation_bytes_per_block(args, tokens: int, act: int, mode: str, option: str) -> int:
    """Bytes one transformer block keeps for backward, for `tokens` = batch x seq tokens.

    Counted from what autograd saves in the Llama block's forward (torchllm/models/llama/
    model.py; checked with saved-tensor hooks), in units of dim per token:
      attention: block input, x*rstd and the normed input (2), q, k and v as SDPA gets them
        (k, v repeated to all heads), the re-laid-out output feeding wo: 7 x dim
      FFN: the residual h, x*rstd and the normed input: 3 x dim; then w1 x, silu(w1 x), w3 x
        and their product: 4 x hidden
    plus per-row float32 statistics (two RMSNorm rstd, SDPA's logsumexp per head).
    Qwen3 (QK-norm, head_dim x heads != dim; checked the same way): its attention keeps q and k
    before and after their norms, q, k, v as SDPA gets them (GQA: k, v not repeated) and the
    output: 4 x (q width + kv width) + the rstd of each q and k head. A MoE layer (instead of
    the FFN's 4 x hidden) keeps per routed copy (k per token) the token, its padded slot, the
    expert output, its float32 weighted copy and 4 x moe_hidden_dim, plus router scores:
    counted for perfectly balanced experts (the CPU path pads every expert to the busiest one's
    load, which adds the imbalance on top).
    `act` is the activation element size (2 under bf16, 4 in fp32).
    With AC, a checkpointed region keeps only its input (and, for "op", the matmul and
    attention outputs).
    """
    dim, kv_dim, hidden = args.dim, args.n_kv_heads * args.head_dim, args.ffn_hidden_dim
    stats = tokens * FP32 * (args.n_heads + 2)
    attention, ffn = 7 * dim, 3 * dim + 4 * hidden
    if getattr(args, "qk_norm", False):
        attention = 3 * dim + 4 * (args.n_heads * args.head_dim + kv_dim)
        stats += tokens * FP32 * (args.n_heads + args.n_kv_heads)
    if getattr(args, "n_experts", 0) and args.moe_every == 1:  # every block's MLP is a MoE
        k = args.n_experts_per_tok
        ffn = 3 * dim + k * (3 * dim + 4 * args.moe_hidden_dim)
        stats += tokens * FP32 * (2 * args.n_experts + k * dim)
    if mode == "full":
        return tokens * dim * act
    if mode == "selective" and option == "op":
        # block input; q, k, v, wo, w1, w3, w2 outputs; SDPA output (+ its logsumexp)
        return tokens * (5 * dim + 2 * kv_dim + 2 * hidden) * act + tokens * FP32 * args.n_heads
    if mode == "selective" and option == "ffn":
        return tokens * (attention + 3 * dim) * act + stats  # the FFN keeps only its input
    if mode == "selective" and option == "attention":
        return tokens * (3 * dim + ffn) * act + tokens * FP32 * 2  # attention keeps its input
    return tokens * (attention + ffn) * act + stats


def moe_params(model) -> dict[str, int]:
    """Parameters of each block's MoE layer (router + experts), by block name; 0 when dense."""
    return {name: sum(p.numel() for m in block.modules() if isinstance(m, MoE)
                      for p in m.parameters())
            for name, block in model.layers.items()}


def estimate_memory(cfg, model_args, world_size: int) -> dict:
    """Per-rank bytes of each term and phase (see the module docstring)."""
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    dims.validate()
    with torch.device("meta"):
        model = models.get(cfg.model.name).build(model_args)
    counts = parameter_counts(model)
    tcfg = cfg.training
    # Where the run would train; "cuda" need not be present here (estimate a GPU job anywhere).
    device = tcfg.device if tcfg.device != "auto" else resolve_device("auto").type
    bf16 = use_bf16(tcfg.mixed_precision, device)
    act = 2 if bf16 else FP32
    shard = dims.dp_shard * dims.cp * dims.tp  # FSDP2 shards over dp_shard x cp
    n_layers = model_args.n_layers
    # All parameters count (every expert is stored); TP splits all but the MoE layers', which
    # it replicates (parallel/tp.py), so those are divided by the FSDP degree only.
    moe = moe_params(model)
    block_params = sum(p.numel() for p in model.layers["0"].parameters())
    block_split = block_params - moe["0"]

    params = ((counts["params"] - sum(moe.values())) * FP32 // shard
              + sum(moe.values()) * FP32 // (shard // dims.tp))
    terms = {"params": params, "grads": params, "optimizer": 2 * params}
    terms["ddp_buckets"] = params if dims.ddp_enabled else 0
    block = block_split * act // dims.tp + moe["0"] * act  # one block's gathered params
    root = (counts["params"] - n_layers * block_params) * act // dims.tp  # embedding, norm, head
    if dims.fsdp_enabled:
        # The root's params stay gathered from forward to backward; after forward, blocks are
        # resharded except the last (default) or none (never).
        kept = {"never": n_layers, "always": 0}.get(cfg.parallelism.fsdp_reshard_after_forward, 1)
        terms["gathered_params"] = root + kept * block
        # In a block's backward: it and the prefetched next are gathered, and two blocks'
        # unsharded float32 gradients exist (one being computed, one being reduce-scattered).
        block_backward_extra = (max(0, 2 - kept) * block + 2 * block_split * FP32 // dims.tp
                                + 2 * moe["0"] * FP32)
    else:
        terms["gathered_params"] = block_backward_extra = 0

    tokens = tcfg.local_batch_size * tcfg.seq_len // dims.cp  # cp splits every sequence
    ac = cfg.activation_checkpoint
    per_block = activation_bytes_per_block(model_args, tokens, act, ac.mode, ac.selective_option)
    if ac.mode == "selective" and ac.selective_option.isdigit():
        every = int(ac.selective_option)
        full = activation_bytes_per_block(model_args, tokens, act, "full", "")
        checkpointed = n_layers // every
        activations = checkpointed * full + (n_layers - checkpointed) * per_block
    else:
        activations = n_layers * per_block
    # With AC, a block's activations are rebuilt in its backward: after the loss backward.
    recompute = 0 if ac.mode == "none" else activation_bytes_per_block(
        model_args, tokens, act, "none", "")
    # The embedding output (first block's input), the final norm's x*rstd and its output.
    activations += 3 * tokens * model_args.dim * act
    terms["activations"] = activations // dims.tp
    terms["recompute"] = recompute // dims.tp

    vocab_tokens = tokens * model_args.vocab_size
    # The logits (kept by the trainer until backward ends) and the float32 log-softmax.
    terms["logits"] = vocab_tokens * act + vocab_tokens * FP32
    # Under bf16 the loss's float32 upcast of the logits lives while log-softmax runs.
    upcast = vocab_tokens * FP32 if act != FP32 else 0

    state = terms["params"] + terms["optimizer"] + terms["ddp_buckets"]
    phases = {
        "forward": state + terms["gathered_params"] + activations + terms["logits"] + upcast,
        # d(log_softmax) and d(logits) in float32 join the forward's tensors.
        "loss backward": state + terms["gathered_params"] + activations + terms["logits"]
        + 2 * vocab_tokens * FP32,
        "optimizer": state + terms["grads"],
    }
    if dims.fsdp_enabled or recompute:
        # Early in the blocks' backward (an upper bound: every gradient, every saved
        # activation): FSDP2's gathered blocks and unsharded gradients, AC's rebuilt block.
        phases["block backward"] = (state + terms["grads"] + terms["gathered_params"]
                                    + block_backward_extra + terms["activations"]
                                    + (terms["recompute"] or per_block // dims.tp))
    peak_phase = max(phases, key=phases.get)
    return {
        "world_size": world_size,
        "dp_shard": dims.dp_shard,
        "dp_replicate": dims.dp_replicate,
        "tp": dims.tp,
        "cp": dims.cp,
        "tokens_per_rank": tokens,
        "activation_bytes": act,
        **counts,
        "flops_per_token": flops_per_token(model, tcfg.seq_len),
        "terms_bytes": terms,
        "phases_bytes": phases,
        "peak_phase": peak_phase,
        "peak_bytes": phases[peak_phase],
        "peak_gib": round(phases[peak_phase] / 1024**3, 3),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
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
        print(json.dumps(estimate_memory(cfg, args, world_size), indent=1))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
