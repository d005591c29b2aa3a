"""Qwen3 shapes: QK-norm, explicit head_dim, GQA, no biases, RoPE theta 1e6; dense or MoE."""

from __future__ import annotations

from dataclasses import dataclass, replace

QWEN3_VOCAB = 151936


@dataclass(frozen=True)
class Qwen3Args:
    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 8
    head_dim: int = 128  # explicit: n_heads * head_dim need not equal dim
    hidden_dim: int = 3072  # dense SwiGLU width
    vocab_size: int = QWEN3_VOCAB
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    # Mixture of experts (n_experts = 0: dense). Every `moe_every`-th block is sparse.
    n_experts: int = 0
    n_experts_per_tok: int = 8
    moe_hidden_dim: int = 768
    norm_topk_prob: bool = True
    moe_every: int = 1
    moe_bias_update_rate: float = 0.0  # > 0: a per-expert routing bias (aux-loss-free balancing)
    # What Llama's shared code reads (attention masks and kernels, RoPE, dropout).
    rope_scaling: bool = False
    dropout: float = 0.0
    attn_mask_type: str = "causal"
    attn_backend: str = "sdpa"
    sliding_window: tuple = ()
    restart_positions_per_document: bool = False

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads="
                             f"{self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.n_experts and not 1 <= self.n_experts_per_tok <= self.n_experts:
            raise ValueError(f"n_experts_per_tok={self.n_experts_per_tok} must be in "
                             f"[1, n_experts={self.n_experts}]")

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hidden_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.n_experts > 0 and (layer_id + 1) % self.moe_every == 0

    def with_overrides(self, **changes) -> "Qwen3Args":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


# The published Qwen3 configs (Hugging Face Qwen/Qwen3-*), vocab 151,936.
flavors: dict[str, Qwen3Args] = {
    "debug": Qwen3Args(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=512,
                       vocab_size=2048, tie_embeddings=True),
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=3072,
                      tie_embeddings=True, max_seq_len=40960),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=6144,
                      tie_embeddings=True, max_seq_len=40960),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=9728,
                    tie_embeddings=True, max_seq_len=40960),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=12288,
                    max_seq_len=40960),
}

moe_flavors: dict[str, Qwen3Args] = {
    "debug": Qwen3Args(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=512,
                       vocab_size=2048, n_experts=8, n_experts_per_tok=2, moe_hidden_dim=128),
    "30B-A3B": Qwen3Args(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, hidden_dim=6144,
                         n_experts=128, n_experts_per_tok=8, moe_hidden_dim=768,
                         max_seq_len=40960),
}
