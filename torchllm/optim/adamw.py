"""AdamW (torch.optim.AdamW) and the parameter groups the AdamW-like optimizers share: 2-D
weights decayed, norms, biases and (unless asked) embedding tables not."""

from __future__ import annotations

import torch
from torch import nn

from torchllm.config.job_config import ConfigError
from torchllm.optim.spec import OptimizerSpec, adamw_state_bytes


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


SPEC = OptimizerSpec(
    name="adamw", build=adamw,
    keys=("lr", "beta1", "beta2", "eps", "weight_decay", "decay_embeddings", "fused"),
    hparams=("lr", "beta1", "beta2", "eps", "weight_decay"),
    state_bytes=adamw_state_bytes,
)
