"""Optimizers and learning-rate schedules."""

from torchllm.optim.lr_schedule import build_lr_scheduler, lr_factor
from torchllm.optim.optimizer import build_optimizer, param_groups

__all__ = ["build_lr_scheduler", "build_optimizer", "lr_factor", "param_groups"]
