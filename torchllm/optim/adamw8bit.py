"""torchao's 8-bit AdamW."""

from __future__ import annotations

import torch
from torch import nn

from torchllm.config.job_config import ConfigError
from torchllm.optim.adamw import param_groups
from torchllm.optim.spec import OptimizerSpec, numel

BLOCK = 256  # torchao's default block_size, which adamw8bit() keeps


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


def adamw8bit_state_bytes(name: str, shape: tuple[int, ...]) -> int:
    """torchao's AdamW8bit (block_size 256): a tensor of >= 4,096 elements, a multiple of 256,
    keeps each moment as int8 codes plus a float32 scale per 256-element block (2 x 1.0156
    bytes per element); smaller ones keep float32 moments, as AdamW."""
    n = numel(shape)
    if n >= 4096 and n % BLOCK == 0:
        return 2 * (n + 4 * (n // BLOCK))
    return 8 * n


SPEC = OptimizerSpec(
    name="adamw8bit", build=adamw8bit,
    keys=("lr", "beta1", "beta2", "eps", "weight_decay", "decay_embeddings"),
    hparams=("lr", "beta1", "beta2", "eps", "weight_decay"),
    state_bytes=adamw8bit_state_bytes,
)
