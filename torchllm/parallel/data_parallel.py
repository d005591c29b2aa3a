"""Data parallelism: FSDP2 (HSDP on a 2-D mesh) or DDP, applied last, over the dp mesh."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from torchllm.models.contract import LanguageModel

RESHARD_POLICIES = ("default", "always", "never")


def reshard_after_forward(policy: str, block_index: int, n_blocks: int) -> bool:
    """always: free every gathered block after forward (least memory, a second all-gather in
    backward); never: keep them (no backward all-gather, the memory of an unsharded model);
    default: always, except the last block, whose params backward needs right away."""
    if policy == "default":
        return block_index < n_blocks - 1
    return policy == "always"


def apply_fsdp(
    model: LanguageModel,
    dp_mesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_policy: str = "default",
    cpu_offload: bool = False,
    expert_mesh=None,
    expert_divide_factor: int = 1,
) -> None:
    """fully_shard each block, the untied embedding, then the root (in place).

    A 2-D dp_mesh (dp_replicate, dp_shard) gives HSDP: shard within a group, all-reduce the
    gradients across groups. MixedPrecisionPolicy casts the sharded fp32 params to param_dtype
    when gathering (this replaces autocast) and reduces gradients in reduce_dtype. Forward
    inputs are not cast (`cast_forward_inputs=False`): activations are already in param_dtype
    (they come out of bf16 weights), and the float32 RoPE table each block receives must stay
    float32 (apply_rope's contract; a bf16 table makes FSDP2 numerics differ from one device's).
    A tied embedding table stays in the root's group: the output projection reads it after the
    last block, so it must stay gathered through the whole forward and backward.

    Expert parallelism (`expert_mesh` given): each block's experts, already DTensors on the ep
    mesh, get their own FSDP2 group over `expert_mesh` (efsdp, or (dp_replicate, efsdp)), whose
    gradient reduction divides by `expert_divide_factor` (the full dp x cp degree; see
    torchllm.parallel.expert_parallel) instead of its own size.
    """
    kwargs = {
        "mesh": dp_mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                          cast_forward_inputs=False),
    }
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    blocks = list(model.layers.values())
    if model.output is not None and model.tok_embeddings is not None:  # (None: PP stages)
        fully_shard(model.tok_embeddings, reshard_after_forward=reshard_policy != "never",
                    **kwargs)
    for i, block in enumerate(blocks):
        reshard = reshard_after_forward(reshard_policy, i, len(blocks))
        if expert_mesh is not None:
            from torchllm.models.moe import GroupedExperts  # (models import parallel/ at load)

            for experts in (m for m in block.modules() if isinstance(m, GroupedExperts)):
                fully_shard(experts, reshard_after_forward=reshard,
                            **{**kwargs, "mesh": expert_mesh})
                experts.set_gradient_divide_factor(float(expert_divide_factor))
                # gloo has no PREMUL_SUM: reduce-scatter a sum, then divide. (Not with a 1-rank
                # shard group: torch then skips the reduce-scatter, divides while copying, and
                # a forced sum would divide a second time.)
                if expert_mesh.device_type != "cuda" and expert_mesh.size(-1) > 1:
                    experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    # FSDP2 never reshards the root after forward (backward would gather it at once).
    fully_shard(model, reshard_after_forward=reshard_policy != "never", **kwargs)


def apply_ddp(model: nn.Module, dp_mesh, bucket_cap_mb: int = 25, comm_hook: str = "none",
              static_buckets: bool = False) -> None:
    """Composable DDP (the module keeps its class and names) over a 1-D dp mesh, in place.

    The DDP reducer is built at the first forward, when it also broadcasts rank 0's weights;
    comm_hook bf16/fp16 halves the all-reduce traffic by sending compressed gradients.
    static_buckets (replica groups, ft/overlap.py): the buckets stay as built, never rebuilt
    after the first step in gradient-ready order, so that a relaunched group's buckets are its
    peers' (DDP rebuilds only without find_unused_parameters, which torchft's own DDP sets too).
    """
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=dp_mesh, bucket_cap_mb=bucket_cap_mb,
              **({"find_unused_parameters": True} if static_buckets else {}))
    if comm_hook != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = {"bf16": default_hooks.bf16_compress_hook,
                "fp16": default_hooks.fp16_compress_hook}[comm_hook]
        model.register_comm_hook(dp_mesh.get_group(), hook)
