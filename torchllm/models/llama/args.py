"""Llama 3 hyperparameters and the named flavors (size presets)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional


@dataclass
class LlamaArgs:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: Optional[int] = None  # None = n_heads (multi-head attention)
    vocab_size: int = 2048
    hidden_dim: Optional[int] = None  # explicit SwiGLU width; None = derived as in Llama
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: bool = False  # Llama-3.1 frequency scaling for long contexts
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_pos: int = 8192
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    dropout: float = 0.0  # attention probabilities and residual branches, training only
    # Attention (torchllm.models.attention): mask, backend, per-layer sliding windows.
    attn_mask_type: str = "causal"  # causal | block_causal (attend within the document only)
    attn_backend: str = "sdpa"  # sdpa | flex
    sliding_window: tuple = ()  # () = off; (w,) = every layer; one per layer (0 = full)
    restart_positions_per_document: bool = False  # RoPE / learned positions restart per document

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head_dim={self.dim // self.n_heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width: explicit, or Llama's 2/3·4·dim rounded up to `multiple_of`."""
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def with_overrides(self, **changes) -> "LlamaArgs":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


LLAMA3_VOCAB = 128256

# The reference 1B is Llama 3.2 1B's shape with FFN hidden = 4·dim and the vocab padded to 2^17.
flavors: dict[str, LlamaArgs] = {
    "debug": LlamaArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048),
    # dim 512 x 6 layers: the throughput benchmark's middle shape (~20M non-embedding params).
    "small": LlamaArgs(dim=512, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=32000),
    "125M": LlamaArgs(
        dim=768, n_layers=12, n_heads=12, n_kv_heads=4, hidden_dim=3072, vocab_size=32000,
        tie_embeddings=True,
    ),
    "1B": LlamaArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden_dim=8192,
        vocab_size=LLAMA3_VOCAB, tie_embeddings=True, rope_scaling=True, rope_scaling_factor=32.0,
    ),
    "3B": LlamaArgs(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, hidden_dim=8192,
        vocab_size=LLAMA3_VOCAB, tie_embeddings=True, rope_scaling=True, rope_scaling_factor=32.0,
    ),
    "8B": LlamaArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
        multiple_of=1024, vocab_size=LLAMA3_VOCAB, rope_scaling=True,
    ),
    "70B": LlamaArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
        multiple_of=4096, vocab_size=LLAMA3_VOCAB, rope_scaling=True,
    ),
}
