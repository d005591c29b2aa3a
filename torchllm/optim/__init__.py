"""Optimizers and learning-rate schedules. Importing this package registers every optimizer.

An optimizer is one file (its builder and its OptimizerSpec) and one line here
(docs/howto_optimizer.md).
"""

from torchllm.optim import adamw, adamw8bit, muon
from torchllm.optim.adamw import param_groups
from torchllm.optim.lr_schedule import build_lr_scheduler, lr_factor
from torchllm.optim.registry import build_optimizer, get, register
from torchllm.optim.spec import OptimizerSpec

register(adamw.SPEC)
register(muon.SPEC)
register(adamw8bit.SPEC)

__all__ = ["OptimizerSpec", "build_lr_scheduler", "build_optimizer", "get", "lr_factor",
           "param_groups", "register"]
