"""Llama 3: RMSNorm, RoPE, grouped-query attention, SwiGLU. Model code only, no parallelism.

Modules are built on the meta device and materialized with `to_empty()` + `init_weights()`, so
a large model never allocates its weights twice. Head counts are inferred from tensor shapes
in `forward`, so tensor parallelism can shard heads without touching this file.
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
from torchllm.models.kv_cache import KVCache
from torchllm.models.llama.args import LlamaArgs


def rope_frequencies(args: LlamaArgs, device=None) -> torch.Tensor:
    """Inverse frequencies of RoPE, with Llama 3.1's long-context scaling when enabled."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d))
    if not args.rope_scaling:
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by the factor, interpolate in between.
    low_wavelen = args.rope_original_max_pos / args.rope_low_freq_factor
    high_wavelen = args.rope_original_max_pos / args.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (args.rope_original_max_pos / wavelen - args.rope_low_freq_factor) / (
        args.rope_high_freq_factor - args.rope_low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / args.rope_scaling_factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / args.rope_scaling_factor, inv_freq)
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, interpolated, scaled)


def rope_table(args: LlamaArgs, device=None) -> torch.Tensor:
    """[max_seq_len, head_dim/2, 2] table of (cos, sin) for every position (on the meta device:
    its shape only, as every meta tensor; arithmetic there runs Python decompositions, the first
    of which imports torch._dynamo: see models/embedding.py)."""
    if torch.empty(0, device=device).is_meta:
        return torch.empty(args.max_seq_len, args.head_dim // 2, 2, device=device)
    inv_freq = rope_frequencies(args, device)
    positions = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x0, x1) of each head by the position's angle, in float32.

    x: [batch, seq, heads, head_dim]; table: [seq, head_dim/2, 2], or [batch, seq, head_dim/2, 2]
    when positions differ per sequence (RoPE restarting at each document). The pairs and the
    (cos, sin) rows are read as complex numbers, so the rotation is one complex multiply
    (x0 + i x1)(cos + i sin): a single kernel forward and backward, where the same formula
    spelled with real slices, products and a stack took ~4x longer on CPU (measured).
    """
    table = table[None] if table.dim() == 3 else table
    if torch.compiler.is_compiling():
        # Inductor generates no code for complex ops (it falls back to eager kernels, with a
        # warning): compiled, the same product spelled in reals fuses into one kernel.
        cos, sin = table[:, :, None, :, 0], table[:, :, None, :, 1]
        if x.dtype == torch.float32:
            return _rotate_pairs(x, cos, sin)
        return _RotatePairs.apply(x, cos, sin)
    angle = torch.view_as_complex(table)[:, :, None, :]  # [batch | 1, seq, 1, head_dim/2]
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * angle).flatten(-2).type_as(x)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope's rotation spelled in reals (for inductor), computed in float32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).type_as(x)


class _RotatePairs(torch.autograd.Function):
    """The compiled rotation of bf16/fp16 inputs, with its backward written as what it is: the
    rotation by -angle. Inductor's kernel for the derived backward (a scatter into each
    selected half, then the cast) took ~6x the forward's time on CPU for bf16 (2.5 vs 1.05 ms
    forward + backward at 4 x 256 tokens x 12 heads x 64, same values); for float32 inputs the
    derived one is as fast, and apply_rope keeps it there."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate_pairs(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate_pairs(grad, cos, -sin), None, None


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (bf16 statistics lose too much precision)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).type_as(x)
        return normed * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def _init_linear(linear: nn.Linear, scale: float = 1.0) -> None:
    """Truncated normal with std 1/sqrt(fan_in) (times `scale`), cut at 3 std."""
    std = scale / math.sqrt(linear.in_features)
    nn.init.trunc_normal_(linear.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs, window: int = 0):
        super().__init__()
        self.head_dim = args.head_dim
        self.window = window  # sliding window of this layer (0 = full causal)
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.dropout = args.dropout
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # Context parallelism sets this: gathers keys/values of every rank's tokens (dim 1).
        self.kv_gather = None

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, *, cache: KVCache | None = None,
        mask=CAUSAL,
    ) -> torch.Tensor:
        """`mask` comes from attention.build_masks (training); with a cache it is built here."""
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = self.position(q, k, rope)
        if cache is not None:
            # Decoding: attend to every cached key plus the new ones, causally among the new.
            start = cache.pos
            k, v = cache.update(self, k, v)
            mask = decode_mask(start, seqlen, k.shape[1], self.window, x.device)
        elif self.kv_gather is not None and more_keys_than_queries(mask, seqlen):
            k, v = self.kv_gather(k, 1), self.kv_gather(v, 1)
        # Grouped-query attention (fewer KV heads) is handled inside attend.
        p = self.dropout if self.training and cache is None else 0.0  # model.dropout
        out = attend(q, k, v, mask, p)
        return self.wo(out.reshape(bsz, seqlen, -1))

    def position(self, q: torch.Tensor, k: torch.Tensor, rope: torch.Tensor):
        """Rotate queries and keys by their positions (families override, e.g. QK-norm)."""
        return apply_rope(q, rope), apply_rope(k, rope)

    def init_weights(self, out_scale: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            _init_linear(linear)
        _init_linear(self.wo, out_scale)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_scale: float) -> None:
        _init_linear(self.w1)
        _init_linear(self.w3)
        _init_linear(self.w2, out_scale)


class TransformerBlock(nn.Module):
    attention_cls = Attention  # families subclass the block with their own attention / MLP

    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        window = layer_windows(args.sliding_window, args.n_layers)[layer_id]
        self.attention = self.attention_cls(args, window)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = self.build_mlp(layer_id, args)
        # Residual-branch outputs are scaled down so the residual stream's variance stays O(1).
        self.out_scale = 1.0 / math.sqrt(2 * args.n_layers)
        self.dropout = args.dropout  # on each residual branch (and attention probabilities)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, *, cache: KVCache | None = None, mask=CAUSAL
    ) -> torch.Tensor:
        # The cache and mask are keyword arguments: positional inputs stay (x, rope), as hooks
        # that re-lay-out module inputs (tensor parallelism) expect.
        h = x + F.dropout(self.attention(self.attention_norm(x), rope, cache=cache, mask=mask),
                          self.dropout, self.training)
        return h + F.dropout(self.feed_forward(self.ffn_norm(h)), self.dropout, self.training)

    def build_mlp(self, layer_id: int, args) -> nn.Module:
        return FeedForward(args.dim, args.ffn_hidden_dim)

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_scale)
        self.feed_forward.init_weights(self.out_scale)


class Transformer(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]."""

    block_cls = TransformerBlock  # a family that reuses this skeleton sets its own block
    rope_table = staticmethod(rope_table)  # ... and RoPE table

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = Embedding(args.vocab_size, args.dim)
        # A dict (not a list) keeps parameter names stable when layers are wrapped or removed.
        self.layers = nn.ModuleDict(
            {str(i): self.block_cls(i, args) for i in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # Tied: the output projection reads the embedding table directly, so no parameter is
        # shared between two modules (sharing breaks under to_empty and per-module sharding).
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, False)
        self.register_buffer("rope_cache", self.rope_table(args), persistent=False)
        self.windows = layer_windows(args.sliding_window, args.n_layers)
        # Context parallelism sets this (and each attention's): gathers a tensor over the cp ranks.
        self.kv_gather = None

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None,
                targets: torch.Tensor | None = None, loss_chunk_tokens: int = 4096,
                layout: TokenLayout | None = None, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None,
                token_index: torch.Tensor | None = None,
                loss_impl: str = "torch") -> torch.Tensor:
        """Training passes no cache. With a `KVCache`, `tokens` continue the cached ones (their
        positions start at `cache.pos`), and the cache is advanced past them. With `targets`,
        returns the summed token cross entropy instead of the logits (training.chunked_loss).
        `layout` says where the tokens sit (documents, window index; attention.TokenLayout), or
        `positions` (each token's position in its document) from which it is built.
        A pipeline stage (torchllm.parallel.pipeline) lacks the embedding (it takes hidden
        states) or the final norm and head (it returns hidden states); under context
        parallelism it gets the layout's fields as per-sequence tensors (`positions`, `doc_ids`,
        `token_index`: a context-parallel share, see context_parallel.ContextParallel.shard)."""
        if doc_ids is not None:  # a layout already made (window positions, documents, index)
            layout = TokenLayout(positions=positions, doc_ids=doc_ids,
                                 index=None if token_index is None else token_index[0])
        elif positions is not None:
            layout = TokenLayout.from_positions(positions)
        start = 0 if cache is None else cache.pos
        # (A later stage's hidden states may be sequence-sharded by TP: positions are whole.)
        seqlen = tokens.shape[1] if positions is None else positions.shape[1]
        if start + seqlen > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {start + seqlen} > model max_seq_len {self.args.max_seq_len}"
            )
        masks = {}
        if cache is not None or layout is None:
            rope = self.rope_cache[start : start + seqlen]
        elif self.args.restart_positions_per_document and layout.positions is not None:
            rope = self.rope_cache[layout.positions]  # [B, S, head_dim/2, 2]
        elif layout.index is not None:
            rope = self.rope_cache[layout.index]
        else:
            rope = self.rope_cache[:seqlen]
        if cache is None:
            masks = build_masks(self.windows, seqlen, tokens.device, layout=layout,
                                mask_type=self.args.attn_mask_type,
                                backend=self.args.attn_backend,
                                kv_gather=self.kv_gather if layout and layout.index is not None
                                else None)
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        for name, layer in self.layers.items():
            h = layer(h, rope, cache=cache, mask=masks.get(self.windows[int(name)]))
        if cache is not None:
            cache.pos += seqlen
        if self.norm is None:  # a pipeline stage before the last
            return h
        h = self.norm(h)
        return lm_head(h, self.tok_embeddings, self.output, targets, loss_chunk_tokens,
                       loss_impl)

    def set_kv_gather(self, gather) -> None:
        """Context parallelism: the mask's key indices and every attention gather with it."""
        self.kv_gather = gather
        for block in self.layers.values():
            block.attention.kv_gather = gather

    def init_buffers(self, device: torch.device) -> None:
        """The RoPE table, computed on the CPU (as a single process's build) and moved."""
        self.rope_cache = self.rope_table(self.args, device=torch.device("cpu")).to(device)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialize every parameter and buffer in place (after `to_empty`)."""
        device = buffer_device or self.rope_cache.device
        self.rope_cache = self.rope_table(self.args, device=device)
        if self.tok_embeddings is not None:  # (None: a later pipeline stage)
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=0.02)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            _init_linear(self.output)
