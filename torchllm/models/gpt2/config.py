"""gpt2's own [model] keys: the shape keys its args take (torchllm/models/shape.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torchllm.models import shape


@dataclass
class GPT2Config:
    dim: Optional[int] = shape.dim()
    n_layers: Optional[int] = shape.n_layers()
    n_heads: Optional[int] = shape.n_heads()
    hidden_dim: Optional[int] = shape.hidden_dim()
