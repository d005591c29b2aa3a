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
    # The [optimizer] keys the builder reads (fields of config/sections.py's Optimizer).
    keys: tuple[str, ...]
    # Those of `keys` whose values live in the param groups, hence in a checkpoint: on resume
    # the checkpoint's value is kept unless checkpoint.optimizer_hparams_from = 'config'.
    hparams: tuple[str, ...]
