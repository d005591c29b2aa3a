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
optimizer step (models/moe.update_expert_bias; never under LoRA, whose base, biases included,
stays bit-identical) and logs them:
  moe/expert_bias_absmax                largest |bias| over layers and experts
  moe/expert_bias/e<i>                  bias of expert i, mean over layers (<= 16 experts)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchllm.callbacks import Callback, StepReport
from torchllm.log import logger
from torchllm.models.moe import MoE, moe_layers, update_expert_bias

PER_EXPERT_MAX = 16


def token_groups(dims) -> list:
    """The groups whose ranks route other tokens through the same MoE layers, summed in turn:
    data-parallel, then context-parallel (TP ranks route the same tokens)."""
    return [g for g in (dims.dp_group, dims.cp_group) if g is not None]


class MoEStats(Callback):
    def __init__(self, layers: list[MoE], log_freq: int, total_steps: int, groups=(),
                 pp_group=None, n_experts: int = 0):
        self.layers, self.log_freq, self.total_steps = layers, log_freq, total_steps
        self.n_experts = n_experts or layers[0].n_experts
        self.groups = groups  # summed over each in turn: dp, then cp
        self.pp_group = pp_group  # pipeline: each rank holds other layers; combined over it

    @classmethod
    def from_context(cls, ctx) -> "MoEStats | None":
        layers, dims = moe_layers(ctx.module.model), ctx.parallel_dims
        # Under PP every rank of a MoE model takes part (its stages may hold no MoE layer).
        n_experts = getattr(ctx.model_args, "n_experts", 0) if dims.pp_group is not None else 0
        if not layers and not n_experts:
            return None
        return cls(layers, ctx.cfg.metrics.log_freq, ctx.cfg.training.steps,
                   token_groups(dims), dims.pp_group, n_experts)

    def on_step_end(self, ctx, step: int, metrics: dict) -> StepReport | None:
        if not (step % self.log_freq == 0 or step in (1, self.total_steps)):
            return None
        seen = [m for m in self.layers if m.tokens_per_expert is not None]
        if not seen and self.pp_group is None:
            return None
        n_experts = self.n_experts
        counts = torch.stack([m.tokens_per_expert.float() for m in seen]) if seen \
            else torch.zeros(0, n_experts)  # [layers, E]
        rows = [torch.stack([m.last_aux_loss, m.last_z_loss]) for m in seen
                if m.last_aux_loss is not None]
        losses = torch.stack(rows).to(counts.device) if rows else counts.new_zeros(0, 2)
        for group in self.groups:
            dist.all_reduce(counts, group=group)
            dist.all_reduce(losses, group=group)
            losses = losses / dist.get_world_size(group)
        # Over this rank's layers, then (pipeline) over the other stages' layers too.
        per_layer_max = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)
        sums = torch.cat([losses.sum(dim=0), counts.new_tensor([len(losses)]), counts.sum(dim=0)])
        peak = per_layer_max.max() if len(per_layer_max) else counts.new_zeros(())
        if self.pp_group is not None:
            dist.all_reduce(sums, group=self.pp_group)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.pp_group)
        mean_losses = sums[:2] / sums[2].clamp_min(1)
        scalars = {"moe/aux_loss": float(mean_losses[0]), "moe/z_loss": float(mean_losses[1]),
                   "moe/max_load": float(peak), "moe/dropped_fraction": 0.0}
        if n_experts <= PER_EXPERT_MAX:
            total = sums[3:]
            for e, share in enumerate((total / total.sum().clamp_min(1e-9)).tolist()):
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
    def from_context(cls, ctx) -> "MoEBiasBalancer | None":
        rate = ctx.cfg.model.moe_bias_update_rate
        layers = [m for m in moe_layers(ctx.module.model) if m.expert_bias is not None]
        if rate <= 0 or not layers:
            return None
        if ctx.cfg.lora.enable:  # the routing biases are the base's: frozen like its weights
            logger.info("lora.enable: the MoE routing biases stay frozen (no aux-loss-free "
                        "balancing update; model.moe_bias_update_rate = %g is not applied)", rate)
            return None
        return cls(layers, rate, ctx.cfg.metrics.log_freq, ctx.cfg.training.steps,
                   token_groups(ctx.parallel_dims))

    def on_step_end(self, ctx, step: int, metrics: dict) -> StepReport | None:
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
