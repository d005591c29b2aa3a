"""The toy family's own [model] keys: Llama's shape keys it takes, and its new `mlp_ratio`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torchllm.config.fields import POSITIVE, opt
from torchllm.models import shape


@dataclass
class ToyConfig:
    dim: Optional[int] = shape.dim()
    n_layers: Optional[int] = shape.n_layers()
    n_heads: Optional[int] = shape.n_heads()
    n_kv_heads: Optional[int] = shape.n_kv_heads()
    hidden_dim: Optional[int] = shape.hidden_dim()
    mlp_ratio: Optional[float] = opt(
        None, "The fused MLP's width as a multiple of dim, replacing the flavor's hidden width; "
        "unset = the flavor's", POSITIVE,
    )
