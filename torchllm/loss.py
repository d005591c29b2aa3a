"""Training loss: next-token cross entropy in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

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


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross entropy of hidden @ weight.T, a chunk of tokens at a time.

    Forward keeps only the scalar; backward recomputes each chunk's logits, turns them into
    dlogits = softmax - onehot in float32 and accumulates the two input gradients. Peak extra
    memory is one [chunk, vocab] float32 block instead of the full [tokens, vocab] logits
    (plus their gradient). Under autocast the matmuls run in the autocast dtype in both
    passes, as the plain path's output projection would.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int):
        device_type = hidden.device.type
        ctx.autocast = (torch.is_autocast_enabled(device_type),
                        torch.get_autocast_dtype(device_type))
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[start : start + chunk], weight).float()
            total += F.cross_entropy(logits, targets[start : start + chunk],
                                     ignore_index=IGNORE_INDEX, reduction="sum")
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, targets = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
        with torch.autocast(hidden.device.type, dtype=dtype, enabled=enabled):
            for start in range(0, hidden.shape[0], ctx.chunk):
                h = hidden[start : start + ctx.chunk]
                t = targets[start : start + ctx.chunk]
                dlogits = torch.softmax(F.linear(h, weight).float(), dim=-1)
                # softmax - onehot on valid rows, 0 on ignored ones, with masked ops only:
                # boolean-mask indexing would sync the host with the GPU once per chunk.
                valid = (t != IGNORE_INDEX).unsqueeze(-1)
                dlogits.scatter_add_(-1, t.clamp(min=0).unsqueeze(-1), -valid.float())
                dlogits.mul_(valid)
                # Like autograd through `.float()`: the logits' gradient in the logits' dtype.
                dlogits = (dlogits * grad_total).to(h.dtype)
                grad_hidden[start : start + ctx.chunk] = dlogits @ weight
                grad_weight += (dlogits.T @ h).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None


def chunked_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                              chunk_tokens: int) -> torch.Tensor:
    """Equals `cross_entropy_sum(F.linear(hidden, weight), targets)` in value and gradient,
    without materializing the [tokens, vocab] logits.

    Models call it from their own forward (given targets): under FSDP2 the output weight is only
    unsharded inside the forward of the module group that owns it.
    """
    if isinstance(weight, DTensor):
        raise ValueError("training.chunked_loss needs the whole output weight; it does not "
                         "support tensor parallelism (sharded vocab). Turn one of them off")
    if chunk_tokens < 1:
        raise ValueError(f"training.loss_chunk_tokens = {chunk_tokens}: must be >= 1")
    return _ChunkedCrossEntropy.apply(hidden.flatten(0, -2), weight, targets.flatten(),
                                      chunk_tokens)
