"""The language-model head shared by every family: logits, or the chunked loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchllm.loss import chunked_cross_entropy_sum
from torchllm.models.lora import rows_added


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
    # LoRA's trainable token rows (lora.train_new_tokens) are added to the table read.
    tied = None if output is not None else rows_added(
        tok_embeddings.__dict__.get("cast_weight", tok_embeddings.weight), tok_embeddings)
    if targets is not None:
        weight = tied if output is None else rows_added(output.weight, output)
        return chunked_cross_entropy_sum(h, weight, targets, loss_chunk_tokens, loss_impl)
    if output is None:
        return F.linear(h, tied)
    if getattr(output, "token_delta", None) is not None:
        return F.linear(h, rows_added(output.weight, output), output.bias)
    return output(h)
