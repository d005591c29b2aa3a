"""Expert parallelism: each rank of the ep mesh holds n_experts / ep experts, and the tokens routed
to an expert travel to its rank and back by all-to-all.

Layout (TorchTitan's): EP borrows its ranks from dp_shard x cp. The experts' weights become
DTensors sharded on the expert dim over the `ep` mesh; FSDP2 then shards each rank's experts
again over the remaining `efsdp` ranks (dp_shard x cp / ep; HSDP adds dp_replicate), while every
other weight is sharded over dp_shard x cp as usual. In a checkpoint an expert weight is one
[n_experts, ...] tensor whatever the layout, so DCP reshards between EP degrees.

One MoE layer's expert step on a rank (its MoE sorted its tokens' k copies by global expert):

    counts [E] -- all_to_all --> recv counts [ep, E/ep]: rank s's tokens for each local expert
    tokens (grouped by destination rank) -- all_to_all --> received, grouped by source rank
    permute to local-expert order -> the local experts' grouped matmuls -> un-permute
    results -- all_to_all (the reverse splits) --> back on the tokens' rank, in their order

The token all-to-alls are autograd-aware: the backward of one is the reverse all-to-all, so an
expert's weight gradient sums the contributions of the tokens of every ep rank. FSDP2 then
reduces it over the efsdp (and replicate) ranks, dividing by the full data-parallel degree
(dp x cp, as for other weights) rather than by its own smaller mesh: the ep ranks' share is
already summed in, and the trainer's loss scale (dp x cp / global tokens) expects that divisor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import Shard, distribute_tensor


def apply_ep(model: nn.Module, ep_mesh) -> int:
    """Shard every MoE layer's experts over `ep_mesh` (1-D) and route their tokens there, in
    place, on the meta-device model (before FSDP2). Returns the number of MoE layers."""
    from torchllm.models.moe import MoE  # parallel/ knows models only through this hook

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in layers:
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        dispatcher = ExpertDispatcher(ep_mesh.get_group())
        experts.register_forward_pre_hook(dispatcher.dispatch)
        experts.register_forward_hook(dispatcher.combine)
    return len(layers)


class ExpertDispatcher:
    """The all-to-all around one GroupedExperts: `dispatch` (a forward pre-hook) turns the
    rank's (tokens sorted by global expert, counts [E]) into (received tokens sorted by local
    expert, local counts [E/ep]); `combine` (a forward hook) sends the results back."""

    def __init__(self, group):
        self.group = group
        self.ep = dist.get_world_size(group)
        self._state = None  # (send splits, recv splits, permutation) between the two hooks

    def dispatch(self, module: nn.Module, inputs):
        x, counts = inputs
        n_local = counts.shape[0] // self.ep
        # Rank j gets this rank's counts for its experts; this rank gets [source, local expert].
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv_counts = recv_counts.view(self.ep, n_local)
        send_splits = counts.view(self.ep, n_local).sum(1)
        # The split sizes must be host integers: the one host sync of this layer's dispatch.
        splits = torch.cat([send_splits, recv_counts.sum(1)]).tolist()
        send, recv = splits[:self.ep], splits[self.ep:]
        received = all_to_all_single_autograd(x, recv, send, self.group)
        perm = source_to_expert_order(recv_counts, sum(recv))
        self._state = (send, recv, perm)
        return received[perm], recv_counts.sum(0)

    def combine(self, module: nn.Module, inputs, out: torch.Tensor) -> torch.Tensor:
        send, recv, perm = self._state
        self._state = None
        unpermuted = torch.empty_like(out).index_copy(0, perm, out)  # back to source order
        return all_to_all_single_autograd(unpermuted, send, recv, self.group)


def source_to_expert_order(counts: torch.Tensor, total: int) -> torch.Tensor:
    """counts [sources, experts] (summing to `total`): received rows lie in (source, expert)
    segments; the indices that reorder them into (expert, source) segments, each segment's rows
    kept in order."""
    from torchllm.models.moe import token_slots  # (models import parallel/ at load)

    flat = counts.flatten()
    starts = (torch.cumsum(flat, 0) - flat).view_as(counts)
    by_expert = counts.t().flatten()  # segment lengths in the new order
    seg_start = starts.t().flatten()  # where each of those segments starts in the old order
    seg, offset = token_slots(by_expert, total)  # each row's new segment, its index in it
    return seg_start[seg] + offset
