"""What an optimizer declares: the `OptimizerSpec` the registry (torchllm/optim/registry.py)
names under its `optimizer.name`.

An optimizer is one file (its builder and its SPEC) and one `register(SPEC)` line
(docs/howto_optimizer.md). The trainer builds it through the registry; a resume
(torchllm/checkpoint/resume/hparams.py) reads `hparams` to say which changed keys the checkpoint's
param groups override.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


@dataclass(frozen=True)
class OptimizerSpec:
    name: str  # optimizer.name in configs
    # build(model, optimizer config section, device) -> the optimizer over the model's trainable
    # parameters (one torch.optim.Optimizer, or an OptimizerList driving several as one).
    build: Callable[[nn.Module, Any, torch.device], torch.optim.Optimizer]
    # The [optimizer] keys the builder reads: fields of config/sections.py's Optimizer (the
    # keys every optimizer shares) or of `config`.
    keys: tuple[str, ...]
    # Those of `keys` whose values live in the param groups, hence in a checkpoint: on resume
    # the checkpoint's value is kept unless checkpoint.optimizer_hparams_from = 'config'.
    hparams: tuple[str, ...]
    # Bytes of state the optimizer keeps for one parameter, given its name in the model and its
    # (local) shape: what torchllm.tools.estimate_memory sizes the optimizer term by. None:
    # not declared (the estimate then assumes AdamW's 8 bytes per element and says so).
    state_bytes: Callable[[str, tuple[int, ...]], int] | None = None
    # The optimizer's own [optimizer] keys: a dataclass of opt() fields (torchllm.config.fields),
    # accepted where optimizer.name selects it (torchllm/config/components.py); None: none.
    config: type | None = None


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def adamw_state_bytes(name: str, shape: tuple[int, ...]) -> int:
    """AdamW: two float32 moments (exp_avg, exp_avg_sq) per element."""
    return 8 * numel(shape)
