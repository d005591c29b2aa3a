"""llama3's own [model] keys: the shape keys its args take (torchllm/models/shape.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torchllm.models import shape


@dataclass
class LlamaConfig:
    dim: Optional[int] = shape.dim()
    n_layers: Optional[int] = shape.n_layers()
    n_heads: Optional[int] = shape.n_heads()
    n_kv_heads: Optional[int] = shape.n_kv_heads()
    hidden_dim: Optional[int] = shape.hidden_dim()
    ffn_dim_multiplier: Optional[float] = shape.ffn_dim_multiplier()
