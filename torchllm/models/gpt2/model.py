"""GPT-2: learned positions, LayerNorm with bias, GELU (tanh) MLP, biases everywhere, tied output.

Module names mirror the Llama model's (`tok_embeddings`, `layers.<i>.attention.wq/wk/wv/wo`,
`feed_forward.w1/w2`, `norm`, `output`), so per-block wrapping (activation checkpointing,
compile, FSDP) and name-based tensor-parallel plans apply to it as to Llama. The MLP has no `w3`
(no gate), the linear layers carry biases, and blocks take no rotary table. Built on the meta
device, materialized with `to_empty()` + `init_weights()`, and decoded incrementally with the
same KV-cache protocol as Llama (`cache.pos`, `cache.update(layer, k, v)`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from torchllm.models.attention import (
    CAUSAL,
    TokenLayout,
    attend,
    build_masks,
    decode_mask,
    layer_windows,
    more_keys_than_queries,
)
from torchllm.models.embedding import Embedding
from torchllm.models.head import lm_head
from torchllm.models.gpt2.args import GPT2Args

INIT_STD = 0.02  # GPT-2's initializer range


def _init_linear(linear: nn.Linear, std: float) -> None:
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


def _reset_norm(norm: nn.LayerNorm) -> None:
    nn.init.ones_(norm.weight)
    nn.init.zeros_(norm.bias)


class Attention(nn.Module):
    """Causal multi-head self-attention; heads are inferred from shapes (TP shards them)."""

    def __init__(self, args: GPT2Args, window: int = 0):
        super().__init__()
        self.head_dim = args.head_dim
        self.window = window  # sliding window of this layer (0 = full causal)
        self.wq = nn.Linear(args.dim, args.dim)
        self.wk = nn.Linear(args.dim, args.dim)
        self.wv = nn.Linear(args.dim, args.dim)
        self.dropout = args.dropout
        self.wo = nn.Linear(args.dim, args.dim)
        # Context parallelism sets this: gathers keys/values of every rank's tokens (dim 1).
        self.kv_gather = None

    def forward(self, x: torch.Tensor, *, cache=None, mask=CAUSAL) -> torch.Tensor:
        """`mask` comes from attention.build_masks (training); with a cache it is built here."""
        bsz, seqlen, _ = x.shape
        q, k, v = (w(x).view(bsz, seqlen, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        if cache is not None:
            # Decoding: attend to every cached key plus the new ones, causally among the new.
            start = cache.pos
            k, v = cache.update(self, k, v)
            mask = decode_mask(start, seqlen, k.shape[1], self.window, x.device)
        elif self.kv_gather is not None and more_keys_than_queries(mask, seqlen):
            k, v = self.kv_gather(k, 1), self.kv_gather(v, 1)
        p = self.dropout if self.training and cache is None else 0.0  # model.dropout
        out = attend(q, k, v, mask, p)
        return self.wo(out.reshape(bsz, seqlen, -1))

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            _init_linear(linear, INIT_STD)
        _init_linear(self.wo, out_std)


class FeedForward(nn.Module):
    """w2(gelu_tanh(w1 x)): GPT-2's MLP (the tanh approximation is what GPT-2 was trained with)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.w2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))

    def init_weights(self, out_std: float) -> None:
        _init_linear(self.w1, INIT_STD)
        _init_linear(self.w2, out_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: GPT2Args):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args, layer_windows(args.sliding_window, args.n_layers)[layer_id])
        self.ffn_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        # GPT-2 scales the residual projections' init by 1/sqrt(2·n_layers): two residual adds
        # per block would otherwise grow the residual stream's variance with depth.
        self.out_std = INIT_STD / math.sqrt(2 * args.n_layers)
        self.dropout = args.dropout  # on each residual branch (and attention probabilities)

    def forward(self, x: torch.Tensor, *, cache=None, mask=CAUSAL) -> torch.Tensor:
        h = x + F.dropout(self.attention(self.attention_norm(x), cache=cache, mask=mask),
                          self.dropout, self.training)
        return h + F.dropout(self.feed_forward(self.ffn_norm(h)), self.dropout, self.training)

    def init_weights(self) -> None:
        _reset_norm(self.attention_norm)
        _reset_norm(self.ffn_norm)
        self.attention.init_weights(self.out_std)
        self.feed_forward.init_weights(self.out_std)


class GPT2(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]."""

    def __init__(self, args: GPT2Args):
        super().__init__()
        self.args = args
        self.tok_embeddings = Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        # Tied: the head reads the embedding table directly, as in the Llama model.
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, False)
        self.windows = layer_windows(args.sliding_window, args.n_layers)
        # Context parallelism sets this (and each attention's): gathers a tensor over the cp ranks.
        self.kv_gather = None

    def forward(self, tokens: torch.Tensor, cache=None, targets: torch.Tensor | None = None,
                loss_chunk_tokens: int = 4096, layout: TokenLayout | None = None,
                loss_impl: str = "torch") -> torch.Tensor:
        """Training passes no cache. With a KV cache, `tokens` continue the cached ones (their
        positions start at `cache.pos`), and the cache is advanced past them. With `targets`,
        returns the summed token cross entropy instead of the logits (training.chunked_loss).
        `layout` says where the tokens sit (documents, window index; attention.TokenLayout)."""
        start = 0 if cache is None else cache.pos
        end = start + tokens.shape[1]
        if end > self.args.max_seq_len:
            raise ValueError(f"sequence length {end} > model max_seq_len {self.args.max_seq_len}")
        masks = {}
        if cache is not None or layout is None:
            positions = torch.arange(start, end, device=tokens.device)
        elif self.args.restart_positions_per_document and layout.positions is not None:
            positions = layout.positions  # [B, S]
        elif layout.index is not None:
            positions = layout.index
        else:
            positions = torch.arange(end, device=tokens.device)
        if cache is None:
            masks = build_masks(self.windows, tokens.shape[1], tokens.device, layout=layout,
                                mask_type=self.args.attn_mask_type,
                                backend=self.args.attn_backend,
                                kv_gather=self.kv_gather if layout and layout.index is not None
                                else None)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for name, layer in self.layers.items():
            h = layer(h, cache=cache, mask=masks.get(self.windows[int(name)]))
        if cache is not None:
            cache.pos = end
        h = self.norm(h)
        return lm_head(h, self.tok_embeddings, self.output, targets, loss_chunk_tokens,
                       loss_impl)

    def set_kv_gather(self, gather) -> None:
        """Context parallelism: the mask's key indices and every attention gather with it."""
        self.kv_gather = gather
        for block in self.layers.values():
            block.attention.kv_gather = gather

    def init_buffers(self, device: torch.device) -> None:
        """GPT-2 has no non-persistent buffers (its positions are a learned table)."""
        del device

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialize every parameter in place (after `to_empty`); GPT-2 has no buffers."""
        del buffer_device
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=INIT_STD)
        nn.init.normal_(self.pos_embeddings.weight, mean=0.0, std=INIT_STD)
        for layer in self.layers.values():
            layer.init_weights()
        _reset_norm(self.norm)
        if self.output is not None:
            _init_linear(self.output, INIT_STD)
