"""Training loss: next-token cross entropy in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # targets with this id (padding) contribute nothing to loss or gradient


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token cross entropy, computed from float32 logits.

    Call it outside autocast: a bf16 log-softmax over a large vocab loses enough precision to
    make training silently diverge. Returns a sum so that callers can divide by the token count
    of the whole (global) batch, which keeps gradient accumulation exact.
    """
    return F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
