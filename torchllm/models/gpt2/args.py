"""GPT-2 hyperparameters and the named flavors (the four published sizes plus a debug one)."""

from __future__ import annotations

from dataclasses import dataclass

GPT2_VOCAB = 50257


@dataclass
class GPT2Args:
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    vocab_size: int = GPT2_VOCAB
    hidden_dim: int | None = None  # MLP width; None = 4·dim as in GPT-2
    norm_eps: float = 1e-5
    max_seq_len: int = 1024  # rows of the learned position table (GPT-2's n_positions)
    tie_embeddings: bool = True
    dropout: float = 0.0  # attention probabilities and residual branches, training only
    # Attention (torchllm.models.attention): mask, backend, per-layer sliding windows.
    attn_mask_type: str = "causal"  # causal | block_causal (attend within the document only)
    attn_backend: str = "sdpa"  # sdpa | flex
    sliding_window: tuple = ()  # () = off; (w,) = every layer; one per layer (0 = full)
    restart_positions_per_document: bool = False  # RoPE / learned positions restart per document

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def n_kv_heads(self) -> int:
        """GPT-2 is multi-head attention: one KV head per query head (read by shared code)."""
        return self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hidden_dim if self.hidden_dim is not None else 4 * self.dim


# The published GPT-2 sizes (Radford et al., 2019); 124M = 124,439,808 parameters at vocab 50,257
# with 1,024 positions and tied embeddings.
flavors: dict[str, GPT2Args] = {
    "debug": GPT2Args(dim=256, n_layers=4, n_heads=8, vocab_size=2048),
    "124M": GPT2Args(dim=768, n_layers=12, n_heads=12),
    "350M": GPT2Args(dim=1024, n_layers=24, n_heads=16),
    "774M": GPT2Args(dim=1280, n_layers=36, n_heads=20),
    "1.5B": GPT2Args(dim=1600, n_layers=48, n_heads=25),
}
