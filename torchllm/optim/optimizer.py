"""The optimizer named by optimizer.name: AdamW, Muon (+ AdamW) or torchao's 8-bit AdamW."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchllm.config.job_config import ConfigError
from torchllm.optim.container import OptimizerList
from torchllm.optim.muon import Muon, fast_ns_dtype


def param_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool,
                 params: list[nn.Parameter] | None = None) -> list[dict]:
    """2-D weights are decayed; norms, biases and (unless asked) embedding tables are not.

    Decaying norm gains and biases only pulls them toward zero for no regularization benefit.
    `params` restricts the groups to these parameters (default: all of the model's).
    """
    embedding_params = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)
    }
    decay, no_decay = [], []
    for param in model.parameters() if params is None else params:
        if not param.requires_grad:
            continue
        is_embedding = id(param) in embedding_params
        if param.ndim >= 2 and (decay_embeddings or not is_embedding):
            decay.append(param)
        else:
            no_decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def fused_supported(device: torch.device) -> bool:
    """Whether the installed torch has a fused AdamW kernel for this device type."""
    try:
        probe = nn.Parameter(torch.zeros(1, device=device))
        probe.grad = torch.zeros_like(probe)
        torch.optim.AdamW([probe], fused=True).step()
        return True
    except (RuntimeError, TypeError):
        return False


def resolve_fused(ocfg, device: torch.device) -> bool:
    fused = {"on": True, "off": False, "auto": None}[ocfg.fused]
    if fused is None:
        return fused_supported(device)
    if fused and not fused_supported(device):
        raise ConfigError(
            f"optimizer.fused = 'on' but this torch has no fused AdamW for {device.type}; "
            "use 'auto' or 'off'"
        )
    return fused


def adamw(model: nn.Module, ocfg, device: torch.device, params=None) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        param_groups(model, ocfg.weight_decay, ocfg.decay_embeddings, params),
        lr=ocfg.lr, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps,
        fused=resolve_fused(ocfg, device),
    )


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
    """Muon (torch.optim.Muon; its Newton-Schulz in float32 on CPUs without native bf16) for the
    blocks' matrices, AdamW at optimizer.lr for the rest.

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
        # Newton-Schulz in bf16 only where bf16 matmuls are native (torchllm/optim/muon.py).
        Muon(hidden, lr=ocfg.muon_lr, weight_decay=ocfg.weight_decay,
             momentum=ocfg.muon_momentum, adjust_lr_fn=ocfg.muon_adjust_lr,
             ns_dtype=fast_ns_dtype(device)),
    ])


def adamw8bit(model: nn.Module, ocfg, device: torch.device) -> torch.optim.Optimizer:
    """torchao's AdamW8bit: block-wise 8-bit moments (~4x less state than fp32 AdamW).

    torchao compiles its step with torch.compile (inductor): CUDA and CPU (needs a C++
    compiler; the first step compiles for a while) are supported.
    """
    if device.type not in ("cuda", "cpu"):
        raise ConfigError(f"optimizer.name = 'adamw8bit' supports cuda and cpu devices, not "
                          f"{device.type}; use adamw")
    try:
        from torchao.optim import AdamW8bit
    except ImportError as e:
        raise ConfigError(f"optimizer.name = 'adamw8bit' needs torchao ({e}); use adamw") from e
    return AdamW8bit(
        param_groups(model, ocfg.weight_decay, ocfg.decay_embeddings),
        lr=ocfg.lr, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps,
    )


def build_optimizer(model: nn.Module, ocfg, device: torch.device) -> torch.optim.Optimizer:
    builders = {"adamw": adamw, "muon": muon, "adamw8bit": adamw8bit}
    if ocfg.name not in builders:
        raise ConfigError(f"optimizer.name = {ocfg.name!r}: use one of {sorted(builders)}")
    return builders[ocfg.name](model, ocfg, device)
