"""Qwen3 (dense and MoE): Llama's block with RMSNorm on each query/key head (QK-norm), an
explicit head_dim, and, in the MoE variant, a routed mixture of SwiGLU experts as the MLP.

RoPE follows Qwen's (Hugging Face's) layout: element i of a head rotates with element
i + head_dim/2, so Hugging Face weights load without any permutation. Module names match
Llama's (attention.wq/wk/wv/wo, feed_forward.w1/w2/w3, ...), so the same parallelize function
(TP plan, AC, compile, FSDP2) applies.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from torchllm.models.head import lm_head
from torchllm.models.llama.model import FeedForward, KVCache, RMSNorm, _init_linear
from torchllm.models.moe import MoE
from torchllm.models.qwen3.args import Qwen3Args


def rope_table(args: Qwen3Args, device=None) -> torch.Tensor:
    """[max_seq_len, head_dim/2, 2] table of (cos, sin), float32."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d))
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float32),
                         inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope_halves(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate (x_i, x_{i+d/2}) by position angle i, in float32. x: [batch, seq, heads, d]."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    cos, sin = table[None, :, None, :, 0], table[None, :, None, :, 1]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, *,
                cache: KVCache | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.q_norm(self.wq(x).view(bsz, seqlen, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bsz, seqlen, -1, self.head_dim))
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope_halves(q, rope), apply_rope_halves(k, rope)
        mask = None
        if cache is not None:
            start = cache.pos
            k, v = cache.update(self, k, v)
            if seqlen > 1:
                query_pos = torch.arange(start, start + seqlen, device=x.device)
                mask = torch.arange(k.shape[1], device=x.device)[None, :] <= query_pos[:, None]
        n_rep = q.shape[2] // k.shape[2]  # GQA (heads inferred: TP shards them)
        k = k.repeat_interleave(n_rep, dim=2)
        v = v.repeat_interleave(n_rep, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def init_weights(self, out_scale: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            _init_linear(linear)
        _init_linear(self.wo, out_scale)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Qwen3Args):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if args.is_moe_layer(layer_id):
            self.moe = MoE(args.dim, args.moe_hidden_dim, args.n_experts, args.n_experts_per_tok,
                           args.norm_topk_prob)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.out_scale = 1.0 / math.sqrt(2 * args.n_layers)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, *,
                cache: KVCache | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, cache=cache)
        mlp = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + mlp(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_scale)
        (self.moe if hasattr(self, "moe") else self.feed_forward).init_weights(self.out_scale)


class Qwen3(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab] (or the summed loss with targets)."""

    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, False)
        self.register_buffer("rope_cache", rope_table(args), persistent=False)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None,
                targets: torch.Tensor | None = None, loss_chunk_tokens: int = 4096) -> torch.Tensor:
        start = 0 if cache is None else cache.pos
        seqlen = tokens.shape[1]
        if start + seqlen > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {start + seqlen} > model max_seq_len {self.args.max_seq_len}"
            )
        rope = self.rope_cache[start : start + seqlen]
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, rope, cache=cache)
        if cache is not None:
            cache.pos += seqlen
        return lm_head(self.norm(h), self.tok_embeddings, self.output, targets, loss_chunk_tokens)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        device = buffer_device or self.rope_cache.device
        self.rope_cache = rope_table(self.args, device=device)
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=0.02)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        if self.output is not None:
            _init_linear(self.output)
