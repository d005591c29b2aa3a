"""Context parallelism: every sequence is split over the cp ranks; attention sees all keys.

Layout (load-balanced for causal attention): the window is cut into 2·cp chunks and cp rank r
keeps chunks r and 2·cp-1-r, so each rank holds early and late tokens and does the same amount
of causal-attention work. Everything but attention is per token and runs on the local chunk.

Attention (the all-gather scheme of the Llama 3 paper, used for its 128k training): each layer
all-gathers keys and values over the cp group (`gather_sequence`, whose backward reduce-scatters
the key/value gradients), and each rank attends each of its two query chunks to every key chunk
that is not in its future (models/chunked_attention.py): its own chunk causally, earlier chunks
in full, with a (c x c) block mask only for the pairs that documents (block_causal) or a sliding
window cut, merged by log-sum-exp. No (S/cp x S) mask or index grid is built: per rank,
attention keeps O(S/cp) for its queries plus the gathered keys and values (O(S)).
This runs on CPU/gloo as on CUDA/NCCL. (torch's `context_parallel` ring attention has no CPU
path, and no document masks for SDPA.)

Gradients: FSDP2 shards over dp_shard x cp (ParallelDims.fsdp_mesh), so its reduce-scatter
averages over the cp ranks as over the dp ranks; the trainer scales the loss by dp x cp / tokens
and sums the cp ranks' partial losses for reporting (ContextParallel.reduce_loss).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchllm.models.attention import TokenLayout
from torchllm.models.contract import LanguageModel


def head_tail_index(seqlen: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Window indices held by cp rank `rank`: chunks rank and 2·cp-1-rank of 2·cp."""
    chunk = seqlen // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, last])


class _GatherSequence(torch.autograd.Function):
    """All-gather along `dim` over `group`; backward reduce-scatters the gradient.

    Plain c10d calls that complete before they return (on CUDA: ordered on the stream, as the
    functional collectives are). Not torch's functional collectives: with gloo, their
    reduce-scatter in backward, run while the pipeline schedule's p2p sends are in flight,
    corrupted the heap (`malloc(): unaligned tcache chunk detected`, rank abort) in about one
    4-rank pp x cp launch in three on torch 2.13; 0 of 15 with this function.
    """

    @staticmethod
    def forward(ctx, t, dim, group):
        ctx.dim, ctx.group = dim, group
        world = dist.get_world_size(group)
        moved = t.movedim(dim, 0).contiguous()
        out = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
        dist.all_gather_into_tensor(out, moved, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size(ctx.group)
        moved = grad.movedim(ctx.dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // world, *moved.shape[1:]))
        dist.reduce_scatter_tensor(out, moved, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


def gather_sequence(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every cp rank's `t` along `dim` (in rank order); differentiable."""
    return _GatherSequence.apply(t, dim, group)


class KVGather:
    """`gather(t, dim)`: every cp rank's `t` along `dim`; also names this rank's place in the
    head-tail layout (`rank`, `degree`), from which attention describes its mask per chunk pair
    instead of building an (S/cp x S) one (models/chunked_attention.py)."""

    def __init__(self, group):
        self.group = group
        self.rank, self.degree = dist.get_rank(group), dist.get_world_size(group)

    def __call__(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return gather_sequence(t, dim, self.group)


def apply_cp(model: LanguageModel, cp_group) -> None:
    """Make every attention of `model` gather keys/values over `cp_group` (in place).

    The model's `set_kv_gather` (the model contract) hands the gather to the mask's key indices
    and to each attention; attention gathers only when its mask has more keys than it has
    queries, so unsplit forwards (validation, evals) still run as on one rank.
    """
    model.set_kv_gather(KVGather(cp_group))


class ContextParallel:
    """What the training step does differently under cp: split, scale, reduce."""

    def __init__(self, degree: int = 1, rank: int = 0, group=None):
        self.degree, self.rank, self.group = degree, rank, group

    @classmethod
    def from_dims(cls, parallel_dims) -> "ContextParallel":
        if not parallel_dims.cp_enabled:
            return cls()
        group = parallel_dims.cp_group
        return cls(parallel_dims.cp, dist.get_rank(group), group)

    def shard(self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None):
        """(inputs, targets, layout) of this rank's tokens; the identity without cp."""
        if self.degree == 1:
            return inputs, targets, TokenLayout.from_positions(positions)
        seqlen = inputs.shape[1]
        if positions is None:  # one document per window
            positions = torch.arange(seqlen, device=inputs.device).expand_as(inputs)
        full = TokenLayout.from_positions(positions)  # documents are found on the whole window
        index = head_tail_index(seqlen, self.degree, self.rank, inputs.device)
        layout = TokenLayout(positions=full.positions[:, index], doc_ids=full.doc_ids[:, index],
                             index=index)
        return inputs[:, index], targets[:, index], layout

    def reduce_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """Sum the cp ranks' partial loss sums (each rank scored only its tokens)."""
        if self.degree == 1:
            return loss_sum
        dist.all_reduce(loss_sum, group=self.group)
        return loss_sum


__all__ = ["ContextParallel", "KVGather", "apply_cp", "gather_sequence", "head_tail_index"]
