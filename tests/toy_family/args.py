"""The toy family's args and flavors: Llama's, plus one shape key of its own, `mlp_ratio`
(declared in config.py: the loader accepts `model.mlp_ratio` when model.name = toy_llama, and
nothing under torchllm/config/ names it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torchllm.models.llama.args import LlamaArgs


@dataclass
class ToyArgs(LlamaArgs):
    mlp_ratio: Optional[float] = None  # the fused MLP's width as a multiple of dim (wins)

    @property
    def ffn_hidden_dim(self) -> int:
        if self.mlp_ratio is not None:
            return int(self.mlp_ratio * self.dim)
        return super().ffn_hidden_dim


flavors = {"debug": ToyArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96,
                            vocab_size=2048)}
