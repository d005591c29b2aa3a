"""Activation checkpointing: keep fewer activations, recompute them in backward.

Modes (config `[activation_checkpoint]`):
  full                      every block keeps only its input; ~1/3 more compute.
  selective, option "op"    save every second matmul output (the 1st, 3rd, ... of each
                            block's forward) and the attention outputs, recompute the rest
                            (the other matmuls, norms, SiLU, RoPE, elementwise): TorchTitan's
                            trade, about half of full's recompute for about 60% of the bytes
                            that saving every matmul output would keep.
  selective, option N       every Nth block in full, the others untouched.
  selective, "ffn"          only the SwiGLU FFN of each block is recomputed: its hidden
            "attention"     activations are the largest; or only attention.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchllm.config.job_config import ConfigError
from torchllm.models.chunked_attention import running as chunked_attention_running
from torchllm.models.contract import LanguageModel

SUBMODULES = {"ffn": "feed_forward", "attention": "attention"}


def _save_list() -> set:
    """Ops whose outputs 'op' keeps: matmuls (float8's `_scaled_mm` included), the attention
    kernels (the costly ones) and TP's reduce-scatter (recomputing it would communicate again)."""
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    for name in ("_scaled_mm", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    c10d = getattr(torch.ops, "_c10d_functional", None)
    if c10d is not None and hasattr(c10d, "reduce_scatter_tensor"):
        ops.add(c10d.reduce_scatter_tensor.default)
    return ops


def _op_policy_context():
    """A fresh policy per checkpointed call (see _op_policy)."""
    return create_selective_checkpoint_contexts(_op_policy())


def _op_policy():
    """The 'op' policy of one checkpointed call: it counts the block's matmuls, in forward and
    in the recompute separately (the recompute replays the same ops, so both counts agree), and
    saves the odd-numbered ones. In a Llama block that keeps wq, wv, w1 and w2's outputs of
    wq wk wv wo w1 w3 w2 (wk, wo, w3 are recomputed from the saved inputs around them)."""
    save = _save_list()
    counted = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
    seen = {False: 0, True: 0}  # matmuls so far: {is_recompute: count}

    def policy(ctx, op, *args, **kwargs):
        if op not in save:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if chunked_attention_running():
            # a kernel inside context parallelism's chunked attention (a custom autograd
            # Function that saves what its backward reads): caching its kernels too kept every
            # chunk pair's output, and on the float32 path every tile's scores, an (S/cp x S)
            # term. (Other Functions' kernels and collectives stay cached: float8's _scaled_mm,
            # DTensor's reduce-scatters, whose recompute would communicate again.)
            return CheckpointPolicy.PREFER_RECOMPUTE
        if op in counted:
            seen[ctx.is_recompute] += 1
            if seen[ctx.is_recompute] % 2 == 0:  # every second matmul is recomputed
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


def parse_selective_option(option: str) -> str | int:
    """'op', 'ffn', 'attention', or a positive integer N; anything else is a ConfigError."""
    if option in ("op", *SUBMODULES):
        return option
    try:
        every = int(option)
    except ValueError:
        every = 0
    if every < 1:
        raise ConfigError(
            f"activation_checkpoint.selective_option = {option!r}: use 'op', 'ffn', "
            "'attention', or a positive integer N (checkpoint every Nth block)",
            "activation_checkpoint.selective_option",
        )
    return every


def _wrap(module: nn.Module, op_level: bool = False) -> nn.Module:
    return checkpoint_wrapper(
        module, preserve_rng_state=False,
        **({"context_fn": _op_policy_context} if op_level else {}),
    )


def apply_ac(model: LanguageModel, ac_cfg) -> dict[str, int]:
    """Wrap the model's blocks (or their submodules) in place; returns counts per kind."""
    counts: dict[str, int] = defaultdict(int)
    if ac_cfg.mode == "none":
        return counts
    option = parse_selective_option(ac_cfg.selective_option) if ac_cfg.mode == "selective" else None
    for i, (name, block) in enumerate(list(model.layers.items())):
        if ac_cfg.mode == "full" or (isinstance(option, int) and i % option == 0):
            model.layers[name] = _wrap(block)
            counts["block"] += 1
        elif option == "op":
            model.layers[name] = _wrap(block, op_level=True)
            counts["block_op"] += 1
        elif option in SUBMODULES:
            attr = SUBMODULES[option]
            setattr(block, attr, _wrap(getattr(block, attr)))
            counts[attr] += 1
    return dict(counts)
