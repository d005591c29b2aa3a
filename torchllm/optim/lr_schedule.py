"""Learning-rate schedules: linear warmup, then cosine, linear or warmup-stable-decay."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch


def lr_factor(step: int, total_steps: int, warmup_steps: int, decay_type: str,
              min_lr_ratio: float, decay_ratio: float = 0.2) -> float:
    """Multiplier of the peak LR for the optimizer step numbered `step` (1-based).

    Warmup: step/warmup (step 1 is not at zero LR, so no step is wasted). After warmup the
    factor goes from 1 to min_lr_ratio at the last step, along the chosen shape.
    """
    if step <= warmup_steps:
        return step / warmup_steps
    if decay_type == "wsd":
        decay_start = max(warmup_steps, total_steps - int(round(decay_ratio * total_steps)))
        if step <= decay_start:
            return 1.0
        progress = (step - decay_start) / max(1, total_steps - decay_start)
        return 1.0 - (1.0 - min_lr_ratio) * min(progress, 1.0)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if decay_type == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    if decay_type == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr_scheduler.decay_type = {decay_type!r}: use cosine, linear or wsd")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, scfg, total_steps: int,
                       scale: Callable[[int], float] | None = None):
    """LambdaLR whose k-th call (k = completed steps) gives the factor of step k + 1.

    Every param group (Muon's and AdamW's alike) is scaled from its own initial lr. `scale(step)`
    multiplies the factor (the batch-size ramp's LR scaling).
    """
    factor = functools.partial(
        lr_factor,
        total_steps=total_steps,
        warmup_steps=scfg.warmup_steps,
        decay_type=scfg.decay_type,
        min_lr_ratio=scfg.min_lr_ratio,
        decay_ratio=scfg.decay_ratio,
    )
    if scale is None:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: factor(done + 1))
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda done: factor(done + 1) * scale(done + 1)
    )
