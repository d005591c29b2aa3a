"""MoE routing statistics in TensorBoard: load balance, auxiliary losses, dropped tokens.

A training-loop callback, attached only when the model has MoE layers. On logging steps it
writes, summed over the data-parallel ranks' last micro-batch:
  moe/aux_loss, moe/z_loss              mean over MoE layers (unweighted)
  moe/max_load                          max over layers of (busiest expert's tokens / mean)
  moe/dropped_fraction                  tokens not processed by a chosen expert (0: no capacity
                                        limit in torchllm's MoE)
  moe/tokens_per_expert/e<i>            fraction of assignments per expert, all layers
                                        summed (only for models with <= 16 experts)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchllm.callbacks import Callback, StepReport
from torchllm.models.moe import MoE

PER_EXPERT_MAX = 16


class MoEStats(Callback):
    def __init__(self, layers: list[MoE], log_freq: int, total_steps: int, group=None):
        self.layers, self.log_freq, self.total_steps, self.group = layers, log_freq, total_steps, group

    @classmethod
    def from_trainer(cls, trainer) -> "MoEStats | None":
        layers = trainer.moe_layers
        if not layers:
            return None
        return cls(layers, trainer.cfg.metrics.log_freq, trainer.cfg.training.steps,
                   trainer.parallel_dims.dp_group)

    def on_step_end(self, trainer, step: int, metrics: dict) -> StepReport | None:
        if not (step % self.log_freq == 0 or step in (1, self.total_steps)):
            return None
        seen = [m for m in self.layers if m.tokens_per_expert is not None]
        if not seen:
            return None
        counts = torch.stack([m.tokens_per_expert.float() for m in seen])  # [layers, E]
        losses = torch.stack([torch.stack([m.last_aux_loss, m.last_z_loss]) for m in seen
                              if m.last_aux_loss is not None] or [counts.new_zeros(2)])
        if dist.is_initialized():
            world = dist.get_world_size(self.group)
            dist.all_reduce(counts, group=self.group)
            losses = losses.to(counts.device)
            dist.all_reduce(losses, group=self.group)
            losses = losses / world
        mean_losses = losses.mean(dim=0)
        per_layer_max = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)
        scalars = {"moe/aux_loss": float(mean_losses[0]), "moe/z_loss": float(mean_losses[1]),
                   "moe/max_load": float(per_layer_max.max()), "moe/dropped_fraction": 0.0}
        if counts.shape[1] <= PER_EXPERT_MAX:
            total = counts.sum(dim=0)
            for e, share in enumerate((total / total.sum()).tolist()):
                scalars[f"moe/tokens_per_expert/e{e}"] = share
        return StepReport(scalars=scalars)
