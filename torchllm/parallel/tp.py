"""Tensor parallelism: Megatron-style column/row splits plus sequence parallelism, applied as the
family's declared plan says (ModelSpec.tp_plan: module name -> style; torchllm/models/spec.py).

Llama's plan (models/llama/plan.py): wq/wk/wv are split by output columns, i.e. by heads (each
rank owns n_heads/tp query heads and n_kv_heads/tp KV heads; the model infers head counts from
shapes), wo by input rows;
the FFN's w1/w3 by columns and w2 by rows. Between those regions the residual stream and the
norms are sharded on the sequence dim (sequence parallel), which divides their activation
memory by tp: the all-reduce after each row-parallel matmul becomes a reduce-scatter, and the
all-gather before the next column-parallel one costs what the all-reduce saved.

Qwen3's plan adds two styles. `head_norm`: QK-norm (`attention.q_norm` / `k_norm`, one RMSNorm
of size head_dim shared by all heads) runs on the head-sharded q/k: its input is annotated as
sharded on the head dim (dim 2) and its weight is a Replicate DTensor, so DTensor sums the
weight's per-rank gradients (each rank sees only its heads) over tp. `replicated_moe`: a
mixture-of-experts MLP is replicated over tp instead of split: it receives the whole sequence
(all-gathered, as the dense FFN does), every rank routes and computes all tokens, and its output
is cut back to the rank's sequence shard (backward: the output gradient is all-gathered). Every
rank then computes the full, identical gradient of the router and expert weights (Replicate
DTensors), so nothing needs reducing, and routing, the auxiliary losses and the token counts
equal one process's. It costs the MoE's compute tp times and saves no expert memory; expert
parallelism is the way to split experts.
"""

from __future__ import annotations

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

from torchllm.models.contract import LanguageModel
from torchllm.models.spec import TPPlan


def _style(style: str, plan: TPPlan):
    """The torch ParallelStyle of one of the plan's style names (models/spec.py: TP_STYLES)."""
    if style == "vocab_embedding":
        # Vocab-sharded table: each rank looks up its rows; the sum is reduce-scattered
        # onto the sequence dim.
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if style == "position_embedding":  # position rows [seq, dim]: the sequence is dim 0 here
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
    if style == "sequence":
        return SequenceParallel()
    if style == "logits":  # a DTensor sharded by vocabulary: each rank holds 1/tp of the
        # logits (and of their gradient); loss.vocab_parallel_cross_entropy_sum reads them
        return ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                               use_local_output=False)
    if style == "attention_input":
        extra = (None,) * (plan.attention_inputs - 1)  # the RoPE table, if any
        return PrepareModuleInput(input_layouts=(Shard(1), *extra),
                                  desired_input_layouts=(Replicate(), *extra))
    if style == "gather_input":
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel(output_layouts=Shard(1))
    if style == "head_norm":  # QK-norm over the local heads [b, s, h, d]
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if style == "replicated_moe":
        return PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),))
    raise ValueError(f"unknown tensor-parallel style {style!r}")


def apply_tp(model: LanguageModel, tp_mesh, plan: TPPlan) -> None:
    """Shard `model` (untied output layer) over `tp_mesh` as its family's `plan` says, in place."""
    parallelize_module(model, tp_mesh, {name: _style(s, plan) for name, s in plan.top.items()})
    for layer_id, block in model.layers.items():
        block_plan = plan.block_plan(model.args, int(layer_id))
        for name, style in block_plan.items():
            if style == "replicated_moe":  # every parameter a Replicate DTensor
                distribute_module(block.get_submodule(name), tp_mesh, _replicate_params)
        parallelize_module(block, tp_mesh,
                           {name: _style(s, plan) for name, s in block_plan.items()})


def _replicate_params(name: str, module: nn.Module, mesh) -> None:
    """distribute_module's partition_fn: every parameter a Replicate DTensor (buffers stay plain
    tensors, e.g. the router's balancing bias, which every rank updates identically)."""
    for key, param in list(module.named_parameters(recurse=False)):
        if not isinstance(param, DTensor):
            dt = DTensor.from_local(param, mesh, [Replicate()], run_check=False)
            module.register_parameter(key, nn.Parameter(dt, param.requires_grad))
