"""The token (and position) embedding of every model family."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embedding(nn.Embedding):
    """nn.Embedding that draws no values while built on the meta device.

    Models are built on meta first (shapes only; init_weights fills them on the real device),
    where nn.Embedding's normal_ runs torch's Python decomposition, whose first call imports
    torch._dynamo (~0.8 CPU-s per process: every worker and tool that builds a model). On a real
    device it is nn.Embedding, initialisation included."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        delta = getattr(self, "token_delta", None)  # LoRA's trainable token rows (lora.py)
        if delta is None:
            return out
        slot = x - self.token_start
        inside = (slot >= 0) & (slot < delta.shape[0])
        rows = F.embedding(slot.clamp(0, delta.shape[0] - 1), delta)
        return out + rows * inside.unsqueeze(-1).to(rows.dtype)
