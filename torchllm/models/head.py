"""The language-model head shared by every family: logits, or the chunked loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchllm.loss import chunked_cross_entropy_sum


def lm_head(h: torch.Tensor, tok_embeddings: nn.Embedding, output: nn.Linear | None,
            targets: torch.Tensor | None = None, loss_chunk_tokens: int = 4096,
            loss_impl: str = "torch") -> torch.Tensor:
    """Final hidden states -> logits, or with `targets` the summed token cross entropy.

    A tied head (`output is None`) reads the embedding table directly. The chunked loss runs
    here, inside the model's forward, because under FSDP2 the head weight is unsharded only
    during that forward (training.chunked_loss never materializes the full logits).
    """
    # A tied head inside training.cast_weights_once reads the step's bf16 copy of the table.
    # (A last pipeline stage without the embedding has its own `output`.)
    tied = None if output is not None else tok_embeddings.__dict__.get("cast_weight",
                                                                        tok_embeddings.weight)
    if targets is not None:
        weight = tied if output is None else output.weight
        return chunked_cross_entropy_sum(h, weight, targets, loss_chunk_tokens, loss_impl)
    if output is None:
        return F.linear(h, tied)
    return output(h)
