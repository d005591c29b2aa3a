"""Mixture of experts: token-choice top-k routing over grouped SwiGLU experts.

Routing (as Qwen3-MoE): softmax over the router logits in float32, the top-k experts per token,
their probabilities renormalized to sum to 1 when `norm_topk_prob`. Tokens are sorted by expert
and every expert's tokens go through one grouped matmul per projection: `torch._grouped_mm` on
CUDA (bf16, Hopper+), elsewhere a padded batched matmul (`torch.bmm` over [experts, capacity,
dim]) — never a Python loop over experts. No token is dropped (capacity = the largest expert
load of the batch), so the dropped fraction is always 0 here and logged as such.

Load balancing: the Switch-Transformer auxiliary loss of each MoE layer,
    aux = n_experts * sum_e f_e * P_e,  f_e = (top-k assignments to e) / tokens,
                                         P_e = mean router probability of e,
(1 when perfectly balanced with top-1, k with top-k), and an optional router z-loss
(mean of logsumexp(logits)^2). The layer keeps both, with their gradients, in `self.aux_loss`
for the trainer to add (see `auxiliary_loss`), and detached routing statistics for logging.

Auxiliary-loss-free balancing (DeepSeek-V3), with `expert_bias=True`: a per-expert bias (a
buffer, so checkpoints save and reshard it) is added to the router probabilities to pick the
top-k experts only; the gate weights stay the unbiased probabilities. The layer sums its
tokens per expert over a step's micro-batches (`expert_load`); after the optimizer step
`update_expert_bias` sums those over the data-parallel ranks and moves each bias by
rate * sign(mean load - load). The update depends only on the loads' ratios, so counting a
forward twice (activation checkpointing recomputes it) changes nothing.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchllm.loss import IGNORE_INDEX


class GroupedExperts(nn.Module):
    """`n_experts` SwiGLU MLPs stored as one [E, ...] weight per projection."""

    def __init__(self, n_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))  # up
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))  # down

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [tokens, dim] sorted by expert; counts: [E] tokens per expert (sums to tokens).

        Under expert parallelism (torchllm.parallel.expert_parallel) the weights are DTensors
        sharded on the expert dim and hooks around this call exchange the tokens, so x and
        counts here are those of this rank's experts, computed with the local shards."""
        w1, w2, w3 = local(self.w1), local(self.w2), local(self.w3)
        if use_grouped_mm(x):
            return self._grouped(x, counts, w1, w2, w3)
        return self._padded(x, counts, w1, w2, w3)

    @staticmethod
    def _grouped(x: torch.Tensor, counts: torch.Tensor, w1, w2, w3) -> torch.Tensor:
        """torch._grouped_mm over token groups each padded to GROUP_ALIGN rows: the weight
        gradient contracts over the tokens of a group, and the kernel needs each group's start
        16-byte aligned (8 bf16 rows; TorchTitan pads the same way). The buffer has a fixed upper
        bound of rows (no host sync); the zero rows past the last expert's tokens belong to its
        group, so every row is defined and padding adds nothing to any gradient."""
        n_experts = counts.shape[0]
        padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
        ends = torch.cumsum(padded, 0)
        expert, slot = token_slots(counts, x.shape[0])
        rows = (ends - padded)[expert] + slot
        total = -(-(x.shape[0] + n_experts * (GROUP_ALIGN - 1)) // GROUP_ALIGN) * GROUP_ALIGN
        buf = x.new_zeros(total, x.shape[-1]).index_copy(0, rows, x)
        offsets = torch.cat([ends[:-1], ends.new_full((1,), total)]).to(torch.int32)
        gate = torch._grouped_mm(buf, w1.transpose(-2, -1), offs=offsets)
        up = torch._grouped_mm(buf, w3.transpose(-2, -1), offs=offsets)
        out = torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offsets)
        return out[rows]

    @staticmethod
    def _padded(x: torch.Tensor, counts: torch.Tensor, w1, w2, w3) -> torch.Tensor:
        n_experts = counts.shape[0]
        # One host sync per layer on this path. The capacity is rounded up to one of a few
        # shapes: oneDNN (CPU bf16) compiles and caches a kernel per matmul shape, and an exact
        # capacity, new almost every step, grew the process by ~2 MiB a step without bound.
        # Under torch.compile the load is a data-dependent symbol that cannot be branched on:
        # the exact load there (inductor's graph, not a new eager kernel per step).
        load = int(counts.max())
        capacity = max(load, 1) if torch.compiler.is_compiling() else padded_capacity(load)
        expert, slot = token_slots(counts, x.shape[0])
        padded = x.new_zeros(n_experts, capacity, x.shape[-1])
        padded = padded.index_put((expert, slot), x)
        h = F.silu(torch.bmm(padded, w1.transpose(1, 2))) * torch.bmm(padded, w3.transpose(1, 2))
        out = torch.bmm(h, w2.transpose(1, 2))
        return out[expert, slot]

    def init_weights(self, out_scale: float) -> None:
        dim, hidden = self.w1.shape[2], self.w1.shape[1]
        for w, fan_in, scale in ((self.w1, dim, 1.0), (self.w3, dim, 1.0),
                                 (self.w2, hidden, out_scale)):
            std = scale / math.sqrt(fan_in)
            nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)


def token_slots(counts: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For `n_tokens` tokens sorted by expert (`counts` per expert): each token's expert and its
    index among that expert's tokens (no host sync)."""
    starts = torch.cumsum(counts, 0) - counts
    expert = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts,
                                     output_size=n_tokens)
    return expert, torch.arange(n_tokens, device=counts.device) - starts[expert]


def padded_capacity(load: int) -> int:
    """The rows per expert of the padded path for a largest expert load of `load`: at least 8,
    else `load` rounded up to a quarter of its power of two (<= 25 % padding, 4 shapes per
    doubling of the load, so a run's matmul shapes are few whatever its routing does)."""
    if load <= 8:
        return 8
    step = 1 << (load.bit_length() - 3)
    return -(-load // step) * step


def local(w: torch.Tensor) -> torch.Tensor:
    """A weight as a plain tensor: tensor parallelism replicates the MoE's weights as DTensors,
    but routing has data-dependent shapes that DTensor cannot express, so the layer computes on
    the local copy (to_local's backward hands the, identical on every rank, gradient back)."""
    return w.to_local() if isinstance(w, DTensor) else w


GROUP_ALIGN = 8  # rows per token group for torch._grouped_mm (16 bytes of bf16)


def use_grouped_mm(x: torch.Tensor) -> bool:
    """torch._grouped_mm runs on CUDA (bf16, sm90+); everything else takes the padded path."""
    if x.device.type != "cuda" or x.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(x.device)[0] >= 9


class MoE(nn.Module):
    """Router + grouped experts. Input and output [batch, seq, dim]."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, top_k: int,
                 norm_topk_prob: bool = True, expert_bias: bool = False):
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk_prob = n_experts, top_k, norm_topk_prob
        self.gate = nn.Linear(dim, n_experts, bias=False)  # the router
        self.experts = GroupedExperts(n_experts, dim, hidden_dim)
        self.aux_loss: torch.Tensor | None = None  # set by forward (training only)
        self.z_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None  # detached, last forward
        self.last_aux_loss: torch.Tensor | None = None  # detached, for logging
        self.last_z_loss: torch.Tensor | None = None
        if expert_bias:  # aux-loss-free balancing: selection bias, and the step's loads for it
            self.register_buffer("expert_bias", torch.zeros(n_experts))
            self.register_buffer("expert_load", torch.zeros(n_experts), persistent=False)
        else:
            self.expert_bias = self.expert_load = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, dim] -> (router logits, top-k weights, top-k expert ids)."""
        logits = F.linear(x, local(self.gate.weight))
        probs = torch.softmax(logits.float(), dim=-1)
        if self.expert_bias is None:
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
        else:  # the bias picks the experts; the gates are the unbiased probabilities
            experts = torch.topk(probs + self.expert_bias, self.top_k, dim=-1).indices
            weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, weights, experts = self.route(x)
        flat = experts.flatten()  # [tokens * k], token-major
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts)
        token = order // self.top_k
        out_sorted = self.experts(x[token], counts)
        # Weighted sum of each token's k expert outputs, back in token order.
        contrib = out_sorted.float() * weights.flatten()[order, None]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        out = out.index_add(0, token, contrib).to(x.dtype)
        self.tokens_per_expert = counts.detach()
        if self.training and self.expert_bias is not None:
            self.expert_load.add_(counts.detach())
        if self.training:
            self.aux_loss = load_balancing_loss(logits, experts, self.n_experts)
            self.z_loss = torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
            self.last_aux_loss, self.last_z_loss = self.aux_loss.detach(), self.z_loss.detach()
        return out.reshape(shape)

    def init_weights(self, out_scale: float) -> None:
        std = 1.0 / math.sqrt(self.gate.in_features)
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
        self.experts.init_weights(out_scale)
        if self.expert_bias is not None:
            self.expert_bias.zero_()
            self.expert_load.zero_()


@torch.no_grad()
def update_expert_bias(layers: list[MoE], rate: float, groups=()) -> torch.Tensor:
    """Aux-loss-free balancing, after an optimizer step: each layer's bias moves by
    rate * sign(mean load - load), its loads (summed over the step's micro-batches, then over
    the ranks of each of `groups` in turn, so every rank applies the same update) reset.
    Returns the loads [L, E]."""
    layers = [m for m in layers if m.expert_bias is not None]
    loads = torch.stack([m.expert_load for m in layers])
    for group in groups if dist.is_initialized() else ():
        dist.all_reduce(loads, group=group)
    step = rate * torch.sign(loads.mean(dim=1, keepdim=True) - loads)
    for m, delta in zip(layers, step):
        m.expert_bias.add_(delta)
        m.expert_load.zero_()
    return loads


def load_balancing_loss(logits: torch.Tensor, experts: torch.Tensor, n_experts: int):
    """Switch Transformer's loss: n_experts * sum_e f_e * P_e (see the module docstring)."""
    probs = torch.softmax(logits.float(), dim=-1)
    tokens = logits.shape[0]
    f = torch.bincount(experts.flatten(), minlength=n_experts).to(probs.dtype) / tokens
    return n_experts * torch.sum(f * probs.mean(dim=0))


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE layers (found once: the trainer keeps the list for every micro-batch)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def auxiliary_loss(layers: list[MoE], aux_coef: float, z_coef: float,
                   n_layers: int | None = None) -> torch.Tensor | None:
    """The mean over MoE `layers` of the last forward's aux (and z) losses, weighted; None for a
    model without MoE layers. The trainer adds it to the loss of each micro-batch. `n_layers`:
    the divisor when `layers` are part of the model (a pipeline stage's; default: all)."""
    layers = [m for m in layers if m.aux_loss is not None]
    if not layers:
        return None
    total = sum(aux_coef * m.aux_loss + z_coef * m.z_loss for m in layers)
    for m in layers:
        m.aux_loss = m.z_loss = None
    return total / (n_layers or len(layers))


class AuxiliaryLoss:
    """A MoE model's loss path: the token loss plus the layers' auxiliary (and z) losses of the
    last forward, weighted by the micro-batch's trained tokens so that a step optimizes their
    token-weighted mean (the token loss is a sum)."""

    def __init__(self, layers: list[MoE], aux_coef: float, z_coef: float):
        self.layers, self.aux_coef, self.z_coef = layers, aux_coef, z_coef

    def __call__(self, loss: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        aux = auxiliary_loss(self.layers, self.aux_coef, self.z_coef)
        return loss if aux is None else loss + aux * (targets != IGNORE_INDEX).sum()


def token_loss(loss: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A family without loss terms of its own: the token loss as it is."""
    return loss


def family_loss(model: nn.Module, mcfg):
    """`loss(token_loss_sum, targets) -> the micro-batch's objective` for `model`: with MoE
    layers their auxiliary losses join it (model.moe_aux_loss_coef / moe_z_loss_coef)."""
    layers = moe_layers(model)
    if not layers:
        return token_loss
    return AuxiliaryLoss(layers, mcfg.moe_aux_loss_coef, mcfg.moe_z_loss_coef)


class AttachLoss(torch.autograd.Function):
    """`AttachLoss.apply(h, loss)` is `h`, and its backward also differentiates `loss` (with
    gradient 1): a loss computed inside a pipeline stage (MoE auxiliary losses) joins the
    objective through that stage's output, whose backward the schedule runs."""

    @staticmethod
    def forward(ctx, h, loss):
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad_h):
        return grad_h, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad_h.device)


def moe_parameter_counts(model: nn.Module) -> dict[str, int]:
    """Expert parameters in total and those a token uses (top-k of n_experts per layer)."""
    total = active = 0
    for m in model.modules():
        if isinstance(m, MoE):
            n = sum(p.numel() for p in m.experts.parameters())
            total += n
            active += n * m.top_k // m.n_experts
    return {"expert_params": total, "active_expert_params": active}
