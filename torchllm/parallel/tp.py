"""Tensor parallelism for Llama: Megatron-style column/row splits plus sequence parallelism.

Attention: wq/wk/wv are split by output columns, i.e. by heads (each rank owns n_heads/tp query
heads and n_kv_heads/tp KV heads; the model infers head counts from shapes), wo by input rows;
the FFN's w1/w3 by columns and w2 by rows. Between those regions the residual stream and the
norms are sharded on the sequence dim (sequence parallel), which divides their activation
memory by tp: the all-reduce after each row-parallel matmul becomes a reduce-scatter, and the
all-gather before the next column-parallel one costs what the all-reduce saved.

Qwen3 adds two things. QK-norm (`attention.q_norm` / `k_norm`, one RMSNorm of size head_dim
shared by all heads) runs on the head-sharded q/k: its input is annotated as sharded on the head
dim (dim 2) and its weight is a Replicate DTensor, so DTensor sums the weight's per-rank
gradients (each rank sees only its heads) over tp. A mixture-of-experts MLP is replicated over
tp instead of split: it receives the whole sequence (all-gathered, as the dense FFN does), every
rank routes and computes all tokens, and its output is cut back to the rank's sequence shard
(backward: the output gradient is all-gathered). Every rank then computes the full, identical
gradient of the router and expert weights (Replicate DTensors), so nothing needs reducing, and
routing, the auxiliary losses and the token counts equal one process's. It costs the MoE's
compute tp times and saves no expert memory; expert parallelism is the way to split experts.
"""

from __future__ import annotations

import inspect

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def _positional_inputs(module: nn.Module) -> int:
    """Required positional inputs of module.forward (Llama attention: x, rope; GPT-2's: x)."""
    params = inspect.signature(module.forward).parameters.values()
    return sum(p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in params)


def apply_tp(model: nn.Module, tp_mesh) -> None:
    """Shard `model` (Llama or GPT-2, untied output layer) over `tp_mesh`, in place.

    The plan follows the shared module names; GPT-2's extras are handled where they differ:
    learned position embeddings (sharded on the sequence dim like the token embeddings), an
    attention that takes no RoPE table, and a two-matrix MLP (no w3).
    """
    top = {
        # Vocab-sharded table: each rank looks up its rows; the sum is reduce-scattered
        # onto the sequence dim.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # Full logits on every rank, so the loss needs no TP awareness.
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    if hasattr(model, "pos_embeddings"):
        # Position rows [seq, dim]: the sequence is dim 0 here.
        top["pos_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                output_layouts=Shard(0))
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        extra = (None,) * (_positional_inputs(block.attention) - 1)  # the RoPE table, if any
        if hasattr(block.feed_forward, "experts"):  # a mixture of experts: replicated
            mlp_plan = {"feed_forward": PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),))}
            distribute_module(block.feed_forward, tp_mesh, _replicate_params)
        else:
            mlp_plan = {
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            }
            if hasattr(block.feed_forward, "w3"):
                mlp_plan["feed_forward.w3"] = ColwiseParallel()
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), *extra), desired_input_layouts=(Replicate(), *extra)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            **mlp_plan,
        }
        if hasattr(block.attention, "q_norm"):  # QK-norm over the local heads [b, s, h, d]
            for norm in ("attention.q_norm", "attention.k_norm"):
                plan[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)


def _replicate_params(name: str, module: nn.Module, mesh) -> None:
    """distribute_module's partition_fn: every parameter a Replicate DTensor (buffers stay plain
    tensors, e.g. the router's balancing bias, which every rank updates identically)."""
    for key, param in list(module.named_parameters(recurse=False)):
        if not isinstance(param, DTensor):
            dt = DTensor.from_local(param, mesh, [Replicate()], run_check=False)
            module.register_parameter(key, nn.Parameter(dt, param.requires_grad))
