"""Training loss: next-token cross entropy in float32."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

IGNORE_INDEX = -100  # targets with this id (padding) contribute nothing to loss or gradient


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token cross entropy, computed from float32 logits (the reference formulation:
    what `torch.compile` fuses, and what `fused_cross_entropy_sum` must equal).

    Call it outside autocast: a bf16 log-softmax over a large vocab loses enough precision to
    make training silently diverge. Returns a sum so that callers can divide by the token count
    of the whole (global) batch, which keeps gradient accumulation exact.
    """
    if isinstance(logits, DTensor):  # tensor parallelism: vocab-sharded logits
        return vocab_parallel_cross_entropy_sum(logits, targets)
    return F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


# Rows of logits per chunk of the fused loss: ~4 MiB of float32 per chunk, so that a chunk's
# float32 copy, exponentials and gradient stay in cache between the kernels that use them.
_CHUNK_BYTES = 4 << 20
# bf16 logits whose float32 copy is at most this size take the plain kernels (see below).
_PLAIN_MAX_BYTES = 256 << 20


class _FusedCrossEntropy(torch.autograd.Function):
    """cross_entropy_sum without the two [tokens, vocab] float32 buffers eager autograd keeps.

    `F.cross_entropy(logits.float())` writes a float32 copy of the logits, a float32
    log-softmax (saved for backward), then in backward a float32 zero-filled gradient and its
    cast back to the logits' dtype: four full passes over tokens x vocab memory, each freshly
    allocated (on CPU that is page faults as much as bandwidth). Here the logits are read a
    chunk of rows at a time: forward keeps only the summed loss; backward
    recomputes softmax - onehot per chunk in float32 and writes the gradient once, in the
    logits' dtype. Same float32 math, same result up to summation order.
    """

    @staticmethod
    def forward(ctx, logits, targets):
        rows = max(1, _CHUNK_BYTES // (4 * logits.shape[-1]))
        lse = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
        for start in range(0, logits.shape[0], rows):
            # Each row's log-sum-exp in float32 (kept for backward: one float per token).
            lse[start:start + rows] = torch.logsumexp(logits[start:start + rows].float(), dim=-1)
        safe = targets.clamp(min=0).unsqueeze(-1)
        picked = logits.gather(-1, safe).squeeze(-1).float() - lse  # log p(target)
        total = -(picked * (targets != IGNORE_INDEX)).sum()
        ctx.save_for_backward(logits, targets, lse)
        ctx.rows = rows
        return total

    @staticmethod
    def backward(ctx, grad_total):
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        valid = (targets != IGNORE_INDEX).unsqueeze(-1)
        safe = targets.clamp(min=0).unsqueeze(-1)
        for start in range(0, logits.shape[0], ctx.rows):
            end = start + ctx.rows
            # (softmax - onehot) x upstream on valid rows, 0 on ignored ones (masked ops only:
            # no host sync): softmax = exp(logits - lse) in float32, one exponential per entry.
            scale = valid[start:end] * grad_total
            g = torch.sub(logits[start:end], lse[start:end, None]).exp_()  # float32
            g.mul_(scale).scatter_add_(-1, safe[start:end], -scale)
            grad[start:end] = g
        return grad, None


def plain_kernels(logits_numel: int) -> bool:
    """Whether the eager loss takes the plain kernels for bf16 logits of this many entries
    (their float32 copy fits in _PLAIN_MAX_BYTES); the memory estimator follows the same rule."""
    return 4 * logits_numel <= _PLAIN_MAX_BYTES


def fused_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Equals `cross_entropy_sum(logits, targets)` in value and gradient (float32 math); for bf16
    logits too large for `plain_kernels` it reads them chunk by chunk instead of materializing
    float32 copies (the eager default)."""
    # float32 logits need no copies, and there the plain kernels are as fast (measured) and
    # round exactly like every reference loop; vocab-sharded DTensor logits (TP) have their
    # own path (vocab_parallel_cross_entropy_sum, through cross_entropy_sum).
    # Small bf16 logits too: their float32 buffers stay few and reused, and the plain kernels
    # do less arithmetic than the chunked pass (measured in a training step on the AMD EPYC
    # class, 32k vocab: forward + backward 1.5-2.5% faster with the plain kernels at 2k
    # tokens; the chunked pass 13% faster at 4k).
    if logits.dtype == torch.float32 or isinstance(logits, DTensor) or plain_kernels(
            logits.numel()):
        return cross_entropy_sum(logits, targets)
    return _FusedCrossEntropy.apply(logits.flatten(0, -2), targets.flatten())


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed cross entropy of logits split over `group` by vocabulary (Megatron's vocab-parallel
    loss): each rank reads only its [tokens, vocab/tp] columns, a chunk of rows at a time.

    Three all-reduces of one float per token make every rank's log-sum-exp and target logit
    global: the row max (MAX), the sum of exp(logit - max) (SUM) and the target's logit, which
    only the rank owning that vocabulary id contributes (SUM). Backward writes
    softmax - onehot for the rank's columns only, in the logits' dtype; nothing of size
    [tokens, vocab] exists on any rank. Saved: the local logits (already alive) and one float
    per token (the log-sum-exp).
    """

    @staticmethod
    def forward(ctx, local, targets, start, group):
        width = local.shape[-1]
        rows = max(1, _CHUNK_BYTES // (4 * width))
        n = local.shape[0]
        top = torch.empty(n, device=local.device, dtype=torch.float32)
        for s in range(0, n, rows):
            top[s:s + rows] = local[s:s + rows].float().amax(dim=-1)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        sumexp = torch.empty_like(top)
        for s in range(0, n, rows):
            sumexp[s:s + rows] = (local[s:s + rows].float() - top[s:s + rows, None]).exp_().sum(-1)
        dist.all_reduce(sumexp, group=group)
        lse = top.add_(sumexp.log_())  # log-sum-exp over the whole vocabulary
        valid = targets != IGNORE_INDEX
        own = targets - start  # the target's column in this rank's shard, if it has it
        mine = valid & (own >= 0) & (own < width)
        picked = local.gather(-1, own.clamp(0, width - 1)[:, None]).squeeze(-1).float() * mine
        dist.all_reduce(picked, group=group)
        ctx.save_for_backward(local, targets, lse)
        ctx.start, ctx.rows = start, rows
        return ((lse - picked) * valid).sum()

    @staticmethod
    def backward(ctx, grad_total):
        local, targets, lse = ctx.saved_tensors
        width = local.shape[-1]
        grad = torch.empty_like(local)
        valid = (targets != IGNORE_INDEX)[:, None]
        own = (targets - ctx.start)[:, None]
        mine = valid & (own >= 0) & (own < width)
        safe = own.clamp(0, width - 1)
        for s in range(0, local.shape[0], ctx.rows):
            e = s + ctx.rows
            # softmax over the whole vocabulary, restricted to this rank's columns, minus the
            # one-hot target where this rank owns it; 0 on ignored rows (masked ops only).
            g = torch.sub(local[s:e], lse[s:e, None]).exp_().mul_(valid[s:e] * grad_total)
            grad[s:e] = g.scatter_add_(-1, safe[s:e], -(mine[s:e] * grad_total))
        return grad, None, None, None


def vocab_parallel_cross_entropy_sum(logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
    """`cross_entropy_sum` of tensor parallelism's logits, a DTensor sharded over the vocabulary
    (its last dim; tp.py's 'logits' style), without gathering them: each rank holds and
    differentiates 1/tp of the logits. Equals the loss of the gathered logits (float32 math;
    summation order aside). Logits with any other layout are gathered first."""
    if logits.device_mesh.ndim != 1 or logits.placements[0] != Shard(logits.ndim - 1):
        return cross_entropy_sum(logits.full_tensor(), targets)
    mesh, vocab = logits.device_mesh, logits.shape[-1]
    local = logits.to_local()
    # Shard's split: every rank but the last ones holds ceil(vocab / tp) columns, in rank order.
    start = min(mesh.get_local_rank() * -(-vocab // mesh.size()), vocab)
    return _VocabParallelCrossEntropy.apply(local.flatten(0, -2), targets.flatten(), start,
                                            mesh.get_group())


def whole_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits with every vocabulary column on this rank: TP's vocab-sharded DTensor gathered
    (for sampling and scoring, which read whole rows); any other tensor as it is."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


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


def liger_available() -> bool:
    """Whether liger-kernel (an optional dependency) can be imported."""
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def liger_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor,
                            targets: torch.Tensor) -> torch.Tensor:
    """liger-kernel's fused linear cross entropy (Triton, CUDA): the same summed loss of
    hidden @ weight.T, chunked inside its kernels (training.chunked_loss_impl = 'liger')."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    if dtype is not None:  # as autocast would run the output projection
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    out = loss(weight, hidden, targets)
    return (out[0] if isinstance(out, tuple) else out).float()


def chunked_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                              chunk_tokens: int, impl: str = "torch") -> torch.Tensor:
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
    if impl == "liger":
        return liger_cross_entropy_sum(hidden.flatten(0, -2), weight, targets.flatten())
    return _ChunkedCrossEntropy.apply(hidden.flatten(0, -2), weight, targets.flatten(),
                                      chunk_tokens)
