"""Qwen3 (dense and MoE): Llama's skeleton with RMSNorm on each query/key head (QK-norm), an
explicit head_dim, and, in the MoE variant, a routed mixture of SwiGLU experts as the MLP.

Everything else (attention masks and kernels, KV cache, context parallelism, the LM head) is
Llama's code: this module only overrides the attention's positional step, the block's MLP and
the block class. RoPE follows Qwen's (Hugging Face's) layout: element i of a head rotates with
element i + head_dim/2, so Hugging Face weights load without any permutation. Module names match
Llama's (attention.wq/wk/wv/wo, feed_forward.w1/w2/w3, ...), so the same parallelize function
(TP plan, AC, compile, FSDP2) applies; MoE blocks hold `moe` (router + grouped experts) instead.
"""

from __future__ import annotations

import torch
from torch import nn

from torchllm.models.llama import model as llama
from torchllm.models.moe import MoE
from torchllm.models.qwen3.args import Qwen3Args


def apply_rope_halves(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate (x_i, x_{i+d/2}) by position angle i, in float32. x: [batch, seq, heads, d];
    table: [seq, d/2, 2] or [batch, seq, d/2, 2] (positions restarting per document)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    table = table[None] if table.dim() == 3 else table
    cos, sin = table[:, :, None, :, 0], table[:, :, None, :, 1]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Attention(llama.Attention):
    def __init__(self, args: Qwen3Args, window: int = 0):
        super().__init__(args, window)
        self.q_norm = llama.RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = llama.RMSNorm(args.head_dim, args.norm_eps)

    def position(self, q: torch.Tensor, k: torch.Tensor, rope: torch.Tensor):
        """QK-norm over each head, then RoPE in Qwen's half-split layout."""
        return (apply_rope_halves(self.q_norm(q), rope), apply_rope_halves(self.k_norm(k), rope))

    def init_weights(self, out_scale: float) -> None:
        super().init_weights(out_scale)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


class TransformerBlock(llama.TransformerBlock):
    attention_cls = Attention

    def build_mlp(self, layer_id: int, args: Qwen3Args) -> nn.Module:
        if args.is_moe_layer(layer_id):
            return MoE(args.dim, args.moe_hidden_dim, args.n_experts, args.n_experts_per_tok,
                       args.norm_topk_prob, expert_bias=args.moe_bias_update_rate > 0)
        return llama.FeedForward(args.dim, args.hidden_dim)


class Qwen3(llama.Transformer):
    """Token ids [batch, seq] -> logits [batch, seq, vocab] (or the summed loss with targets)."""

    block_cls = TransformerBlock
