"""Gradient norms, parameter norms and update-to-weight ratios of a few watched parameter groups.

A run's health shows in four places: the embeddings, the output head, the first and the last
transformer block. A stalled learning rate or a dying layer shows as an update-to-weight ratio
‖ΔW‖/‖W‖ that drifts far from ~1e-3 long before the loss says anything.

Norms work on plain tensors and on sharded DTensors (FSDP/TP): a DTensor's norm is reduced
over its mesh with `full_tensor()`, so every rank gets the same global value.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

def watched_groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Parameters of the watched groups, found from the model's structure (not names).

    Structure survives wrappers (compile, activation checkpointing, FSDP) that rename
    parameters. With tied embeddings there is no separate output head: its weight is the
    embedding table, reported under "embeddings". With one layer, first and last are the same.
    """
    groups: dict[str, list[nn.Parameter]] = {}
    embeddings = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    if embeddings:
        groups["embeddings"] = embeddings
    head = getattr(model, "output", None)
    if isinstance(head, nn.Module):
        groups["output"] = list(head.parameters())
    layers = getattr(model, "layers", None)
    if layers is not None and len(layers):
        blocks = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
        groups["first_block"] = list(blocks[0].parameters())
        groups["last_block"] = list(blocks[-1].parameters())
    return groups


def _norm(t: torch.Tensor) -> torch.Tensor:
    """float32 L2 norm of one tensor; a DTensor's is reduced over its mesh."""
    n = torch.linalg.vector_norm(t.detach(), dtype=torch.float32)
    return n.full_tensor() if hasattr(n, "full_tensor") else n


def l2_norm(tensors) -> float:
    """L2 norm of the concatenation of `tensors` (as if flattened into one vector)."""
    norms = [_norm(t) for t in tensors]
    if not norms:
        return 0.0
    return torch.linalg.vector_norm(torch.stack(norms)).item()


def grad_norms(groups: dict[str, list[nn.Parameter]]) -> dict[str, float]:
    """Gradient norm of each group; call it before clipping to see the raw gradients."""
    return {
        f"grad_norm/{name}": l2_norm([p.grad for p in params if p.grad is not None])
        for name, params in groups.items()
    }


@contextlib.contextmanager
def track_update(groups: dict[str, list[nn.Parameter]], out: dict[str, float]):
    """Around an optimizer step: adds param norms and ‖ΔW‖/‖W‖ of every group to `out`.

    Copies only the watched groups' (local) weights, once; call it on logging steps only.
    The ratio divides by the norm of the weights before the update.
    """
    before = {name: [p.detach().clone() for p in params] for name, params in groups.items()}
    yield
    for name, params in groups.items():
        deltas = [p.detach() - old for p, old in zip(params, before[name])]
        weight = l2_norm(before[name])
        out[f"update_ratio/{name}"] = l2_norm(deltas) / weight if weight > 0 else float("nan")
        out[f"param_norm/{name}"] = l2_norm(params)
    del before
