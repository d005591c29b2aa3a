"""Reductions of per-rank scalars over the data-parallel ranks, with or without a process group.

Every function works unchanged in a single process (no process group initialized): the
reduction is then the identity. `group=None` means the default (world) group; pass the
data-parallel group when other parallelisms share the world.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce(values: torch.Tensor, op: dist.ReduceOp, group=None) -> torch.Tensor:
    """`values` reduced over the group's ranks (a new tensor; the input is left untouched)."""
    out = values.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(out, op=op, group=group)
    return out


def loss_stats(loss_sum: torch.Tensor, n_tokens: torch.Tensor | int, with_max: bool,
               group=None, processed: torch.Tensor | int | None = None
               ) -> dict[str, torch.Tensor]:
    """The step's loss over all dp ranks: mean per token, and (if asked) the worst rank's mean.

    The mean is sum(losses) / sum(tokens), which equals the average of the ranks' means when
    every rank has the same token count and stays exact when padding makes them differ. One
    all-reduce per step; the max costs a second one, so it is only taken on logging steps.
    Returns 0-dim device tensors: nothing here waits for the device (see `to_host`).
    """
    # float64: token counts of large global batches are not exact in float32 past 2^24.
    tokens = torch.as_tensor(n_tokens, device=loss_sum.device)  # already there in training
    seen = tokens if processed is None else torch.as_tensor(processed, device=loss_sum.device)
    local = torch.stack([loss_sum.detach().double(), tokens.double(), seen.double()])
    total = all_reduce(local, dist.ReduceOp.SUM, group)
    # "trained_tokens": targets the loss counts; "tokens": what the model processed (inputs
    # without padding; with assistant-only loss, the prompts count here but not there).
    stats = {"loss": total[0] / total[1], "trained_tokens": total[1], "tokens": total[2]}
    if with_max:
        stats["loss_max"] = all_reduce(local[0] / local[1], dist.ReduceOp.MAX, group)
    return stats


def to_host(values: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Python floats of a few scalars, with one device-to-host copy (one sync) for all tensors."""
    keys = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    out = dict(values)
    if keys:
        host = torch.stack([values[k].detach().double().reshape(()) for k in keys]).tolist()
        out.update(zip(keys, host))
    return out
