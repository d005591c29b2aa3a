"""Gradient norms, parameter norms and update-to-weight ratios of a few watched parameter groups.

A run's health shows in four places: the embeddings, the output head, the first and the last
transformer block. A stalled learning rate or a dying layer shows as an update-to-weight ratio
‖ΔW‖/‖W‖ that drifts far from ~1e-3 long before the loss says anything.

Norms work on plain tensors and on sharded DTensors (FSDP/TP): a DTensor's norm is reduced
over its mesh (one all-reduce per mesh dim for all tensors together), so every rank gets
the same global value.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchllm.models.contract import LanguageModel


def watched_groups(model: LanguageModel) -> dict[str, list[nn.Parameter]]:
    """Parameters of the watched groups, found from the model's structure (not names).

    Structure survives wrappers (compile, activation checkpointing, FSDP) that rename
    parameters. With tied embeddings there is no separate output head: its weight is the
    embedding table, reported under "embeddings". With one layer, first and last are the same.
    """
    groups: dict[str, list[nn.Parameter]] = {}
    embeddings = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    if embeddings:
        groups["embeddings"] = embeddings
    if model.output is not None:  # (None: tied, or a pipeline stage before the last)
        groups["output"] = list(model.output.parameters())
    if len(model.layers):
        blocks = list(model.layers.values())
        groups["first_block"] = list(blocks[0].parameters())
        groups["last_block"] = list(blocks[-1].parameters())
    return groups


def _local_square(t: torch.Tensor):
    """(reduction, this rank's share of ‖t‖²): reduction is None for a whole tensor, else
    (mesh, the mesh dims t is sharded over) whose ranks' shares add up to ‖t‖²."""
    t = t.detach()
    if isinstance(t, DTensor):
        if any(p.is_partial() for p in t.placements):  # not a parameter or gradient layout
            t = t.full_tensor()
        else:
            dims = tuple(i for i, p in enumerate(t.placements) if p.is_shard())
            square = torch.linalg.vector_norm(t.to_local(), dtype=torch.float32).square()
            return ((t.device_mesh, dims) if dims else None), square
    return None, torch.linalg.vector_norm(t, dtype=torch.float32).square()


def l2_norms(named: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    """L2 norm of each named list of tensors (as if flattened into one vector).

    A sharded DTensor's shares are summed over the mesh dims it is sharded over (replicated
    dims hold the same values already), with one all-reduce per mesh dim for all the tensors
    on that mesh, not one per tensor; the values reach the host in one copy.
    """
    if not named:
        return {}
    shares: dict = {}  # (id(mesh), dims) -> (reduction, [(name, square)])
    for name, tensors in named.items():
        for t in tensors:
            reduction, square = _local_square(t)
            key = None if reduction is None else (id(reduction[0]), reduction[1])
            shares.setdefault(key, (reduction, []))[1].append((name, square))
    squares: dict[str, list[torch.Tensor]] = {name: [] for name in named}
    for reduction, items in shares.values():
        vector = torch.stack([square for _, square in items])
        if reduction is not None:
            mesh, dims = reduction
            for dim in dims:
                dist.all_reduce(vector, group=mesh.get_group(dim))
        for (name, _), square in zip(items, vector):
            squares[name].append(square)
    totals = [torch.stack(s).sum().sqrt() if s else torch.zeros(()) for s in squares.values()]
    device = next((t.device for t in totals if t.device.type != "cpu"), None)
    values = torch.stack([t.to(device) if device else t for t in totals]).tolist()
    return dict(zip(named, values))


def l2_norm(tensors) -> float:
    """L2 norm of the concatenation of `tensors` (as if flattened into one vector)."""
    return l2_norms({"": list(tensors)}).get("", 0.0)


def grad_norms(groups: dict[str, list[nn.Parameter]]) -> dict[str, float]:
    """Gradient norm of each group; call it before clipping to see the raw gradients."""
    return l2_norms({f"grad_norm/{name}": [p.grad for p in params if p.grad is not None]
                     for name, params in groups.items()})


@contextlib.contextmanager
def track_update(groups: dict[str, list[nn.Parameter]], out: dict[str, float]):
    """Around an optimizer step: adds param norms and ‖ΔW‖/‖W‖ of every group to `out`.

    Copies only the watched groups' (local) weights, once; call it on logging steps only.
    The ratio divides by the norm of the weights before the update.
    """
    before = {name: [p.detach().clone() for p in params] for name, params in groups.items()}
    yield
    norms = l2_norms({
        **{f"before/{name}": before[name] for name in groups},
        **{f"delta/{name}": [p.detach() - old for p, old in zip(params, before[name])]
           for name, params in groups.items()},
        **{f"param_norm/{name}": params for name, params in groups.items()},
    })
    for name in groups:
        weight = norms[f"before/{name}"]
        ratio = norms[f"delta/{name}"] / weight if weight > 0 else float("nan")
        out[f"update_ratio/{name}"] = ratio
        out[f"param_norm/{name}"] = norms[f"param_norm/{name}"]
    del before
