"""The generation cache every family here decodes with (a family declares it: ModelSpec.cache_cls).

The protocol the models follow: `model(tokens, cache)` continues the cached tokens (their
positions start at `cache.pos`), each attention calls `cache.update(self, k, v)` and the model
advances `cache.pos` after the forward.
"""

from __future__ import annotations

import torch
from torch import nn


class KVCache:
    """Keys and values of the tokens seen so far, per attention module, for incremental decoding.

    Buffers are allocated at a layer's first call from its key/value shapes, so the head count
    (sharded under tensor parallelism) is never assumed. `pos` is the number of cached tokens;
    the model advances it after each forward.
    """

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.pos = 0
        self.layers: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(
        self, layer: nn.Module, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [batch, seq, kv_heads, head_dim] at `pos`; return all keys/values so far."""
        end = self.pos + k.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; {end} requested")
        if layer not in self.layers:
            shape = (k.shape[0], self.max_len, *k.shape[2:])
            self.layers[layer] = (k.new_zeros(shape), v.new_zeros(shape))
        cache_k, cache_v = self.layers[layer]
        cache_k[:, self.pos : end] = k
        cache_v[:, self.pos : end] = v
        return cache_k[:, :end], cache_v[:, :end]
