"""Reductions over data-parallel ranks that also work in a single process without a group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchllm.ranks import rank, world_size


def rank_and_world(group=None) -> tuple[int, int]:
    """(rank, world size) within `group`; (0, 1) when torch.distributed is not initialized."""
    return rank(group), world_size(group)


def rank_batches(n: int, batch_size: int, group=None) -> list[list[int]]:
    """This rank's share of items 0..n-1 (item i on rank i % world), in batches.

    Every rank gets the same number of batches: a rank out of work gets empty lists, for which
    the caller runs a discarded dummy forward, so sharded models see the same number of forward
    passes everywhere.
    """
    rank, world = rank_and_world(group)
    mine = list(range(rank, n, world))
    n_batches = -(-(-(-n // world)) // batch_size)
    return [mine[b * batch_size : (b + 1) * batch_size] for b in range(n_batches)]


def sum_over_ranks(values: torch.Tensor, group=None) -> torch.Tensor:
    """Element-wise sum of `values` over the ranks of `group` (a no-op in one process)."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values


def gather_objects(obj, group=None) -> list:
    """Every rank's `obj`, in rank order (a one-element list in one process)."""
    _, world = rank_and_world(group)
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out
