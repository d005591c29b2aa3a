"""Muon (torch.optim.Muon; its Newton-Schulz in float32 on CPUs without native bf16, see
muon_ns.py) for the blocks' 2-D weights, AdamW for the rest."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchllm.config.job_config import ConfigError
from torchllm.optim.adamw import adamw
from torchllm.optim.container import OptimizerList
from torchllm.optim.muon_ns import Muon, fast_ns_dtype
from torchllm.optim.spec import OptimizerSpec, numel


def muon_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's, AdamW's): the 2-D weights inside the transformer blocks go to Muon; embeddings,
    the output head, norms and biases to AdamW (orthogonalized updates suit hidden matrices
    only; the embedding lookup and the logits layer behave differently)."""
    hidden, rest = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        in_block = name.startswith("layers.") or ".layers." in name
        (hidden if in_block and param.ndim == 2 else rest).append(param)
    return hidden, rest


def muon(model: nn.Module, ocfg, device: torch.device) -> OptimizerList:
    """Muon (torch.optim.Muon) for the blocks' matrices, AdamW at optimizer.lr for the rest.

    AdamW comes first, so `param_groups[0]["lr"]` (what metrics log) is the AdamW rate.
    """
    hidden, rest = muon_params(model)
    if any(isinstance(p, DTensor) for p in hidden):
        raise ConfigError(
            "optimizer.name = 'muon' needs whole (unsharded) weight matrices: torch.optim.Muon "
            "orthogonalizes each full matrix, and FSDP2/TP shard them. Use muon with a single "
            "device or parallelism.dp_mode = 'ddp'; use adamw or adamw8bit with FSDP2/TP"
        )
    if not hidden:
        raise ConfigError(f"optimizer.name = 'muon': model {type(model).__name__} has no "
                          "2-D weights under 'layers.' for Muon")
    return OptimizerList([
        adamw(model, ocfg, device, rest),
        # Newton-Schulz in bf16 only where bf16 matmuls are native (torchllm/optim/muon_ns.py).
        Muon(hidden, lr=ocfg.muon_lr, weight_decay=ocfg.weight_decay,
             momentum=ocfg.muon_momentum, adjust_lr_fn=ocfg.muon_adjust_lr,
             ns_dtype=fast_ns_dtype(device)),
    ])


def muon_state_bytes(name: str, shape: tuple[int, ...]) -> int:
    """Muon's float32 momentum buffer (4 bytes per element) for the blocks' matrices
    (muon_params), AdamW's two moments (8 bytes) for the rest."""
    in_block = name.startswith("layers.") or ".layers." in name
    return (4 if in_block and len(shape) == 2 else 8) * numel(shape)


SPEC = OptimizerSpec(
    name="muon", build=muon,
    keys=("lr", "beta1", "beta2", "eps", "weight_decay", "decay_embeddings", "fused", "muon_lr",
          "muon_momentum", "muon_adjust_lr"),
    hparams=("lr", "beta1", "beta2", "eps", "weight_decay", "muon_lr", "muon_momentum"),
    state_bytes=muon_state_bytes,
)
