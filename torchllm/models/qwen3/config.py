"""qwen3's (and qwen3_moe's) own [model] keys: the shape keys its args take
(torchllm/models/shape.py), head_dim among them (Qwen3's heads are not dim / n_heads wide)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torchllm.models import shape


@dataclass
class Qwen3Config:
    dim: Optional[int] = shape.dim()
    n_layers: Optional[int] = shape.n_layers()
    n_heads: Optional[int] = shape.n_heads()
    n_kv_heads: Optional[int] = shape.n_kv_heads()
    head_dim: Optional[int] = shape.head_dim()
    hidden_dim: Optional[int] = shape.hidden_dim()
