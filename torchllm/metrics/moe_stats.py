"""MoE routing statistics in TensorBoard (load balance, auxiliary losses, dropped tokens), and
the auxiliary-loss-free balancing that acts on the same statistics after each step.

A training-loop callback, attached only when the model has MoE layers. On logging steps it
writes, summed over the data- and context-parallel ranks' last micro-batch (each routes tokens of
its own; TP ranks route the same ones):
  moe/aux_loss, moe/z_loss              mean over MoE layers (unweighted)
  moe/max_load                          max over layers of (busiest expert's tokens / mean)
  moe/dropped_fraction                  tokens not processed by a chosen expert (0: no capacity
                                        limit in torchllm's MoE)
  moe/tokens_per_expert/e<i>            fraction of assignments per expert, all layers
                                        summed (only for models with <= 16 experts)
With model.moe_bias_update_rate > 0, `MoEBiasBalancer` updates the routing biases after every
optimizer step (models/moe.update_expert_bias) and logs them:
  moe/expert_bias_absmax                largest |bias| over layers and experts
  moe/expert_bias/e<i>                  bias of expert i, mean over layers (<= 16 experts)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchllm.callbacks import Callback, StepReport
from torchllm.models.moe import MoE, update_expert_bias

PER_EXPERT_MAX = 16


class MoEStats(Callback):
    def __init__(self, layers: list[MoE], log_freq: int, total_steps: int, groups=()):
        self.layers, self.log_freq, self.total_steps = layers, log_freq, total_steps
        self.groups = groups  # summed over each in turn: dp, then cp

    @classmethod
    def from_trainer(cls, trainer) -> "MoEStats | None":
        layers = trainer.moe_layers
        if not layers:
            return None
        dims = trainer.parallel_dims
        return cls(layers, trainer.cfg.metrics.log_freq, trainer.cfg.training.steps,
                   [g for g in (dims.dp_group, dims.cp_group) if g is not None])

    def on_step_end(self, trainer, step: int, metrics: dict) -> StepReport | None:
        if not (step % self.log_freq == 0 or step in (1, self.total_steps)):
            return None
        seen = [m for m in self.layers if m.tokens_per_expert is not None]
        if not seen:
            return None
        counts = torch.stack([m.tokens_per_expert.float() for m in seen])  # [layers, E]
        losses = torch.stack([torch.stack([m.last_aux_loss, m.last_z_loss]) for m in seen
                              if m.last_aux_loss is not None] or [counts.new_zeros(2)])
        losses = losses.to(counts.device)
        for group in self.groups:
            dist.all_reduce(counts, group=group)
            dist.all_reduce(losses, group=group)
            losses = losses / dist.get_world_size(group)
        mean_losses = losses.mean(dim=0)
        per_layer_max = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)
        scalars = {"moe/aux_loss": float(mean_losses[0]), "moe/z_loss": float(mean_losses[1]),
                   "moe/max_load": float(per_layer_max.max()), "moe/dropped_fraction": 0.0}
        if counts.shape[1] <= PER_EXPERT_MAX:
            total = counts.sum(dim=0)
            for e, share in enumerate((total / total.sum()).tolist()):
                scalars[f"moe/tokens_per_expert/e{e}"] = share
        return StepReport(scalars=scalars)


class MoEBiasBalancer(Callback):
    """Aux-loss-free load balancing: after each optimizer step, every MoE layer's routing bias
    moves towards balance by the step's token counts summed over the data-parallel ranks and
    the context-parallel ones (each holds other tokens; TP ranks route the same tokens, so
    their counts are not added again). A step the loss guard dropped changes no bias (its
    counts are discarded)."""

    def __init__(self, layers: list[MoE], rate: float, log_freq: int, total_steps: int,
                 groups=()):
        self.layers, self.rate, self.groups = layers, rate, groups
        self.log_freq, self.total_steps = log_freq, total_steps

    @classmethod
    def from_trainer(cls, trainer) -> "MoEBiasBalancer | None":
        rate = trainer.cfg.model.moe_bias_update_rate
        layers = [m for m in trainer.moe_layers if m.expert_bias is not None]
        if rate <= 0 or not layers:
            return None
        dims = trainer.parallel_dims
        groups = [g for g in (dims.dp_group, dims.cp_group) if g is not None]
        return cls(layers, rate, trainer.cfg.metrics.log_freq, trainer.cfg.training.steps,
                   groups)

    def on_step_end(self, trainer, step: int, metrics: dict) -> StepReport | None:
        if metrics.get("skipped"):
            for m in self.layers:
                m.expert_load.zero_()
            return None
        update_expert_bias(self.layers, self.rate, self.groups)
        if not (step % self.log_freq == 0 or step in (1, self.total_steps)):
            return None
        bias = torch.stack([m.expert_bias for m in self.layers])  # [layers, E]
        scalars = {"moe/expert_bias_absmax": float(bias.abs().max())}
        if bias.shape[1] <= PER_EXPERT_MAX:
            for e, value in enumerate(bias.mean(dim=0).tolist()):
                scalars[f"moe/expert_bias/e{e}"] = value
        return StepReport(scalars=scalars)
