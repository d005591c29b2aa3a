"""Validation loss: held-out batches, no gradients, the token-weighted mean over the
data-parallel ranks (each scores its share of a fixed held-out set: eval.in_training)."""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Iterable

import torch
from torch import nn

from torchllm.eval.reduce import sum_over_ranks
from torchllm.models.attention import TokenLayout
from torchllm.loss import IGNORE_INDEX, fused_cross_entropy_sum


class ValidationStopped(Exception):
    """A stop signal ended a validation before its last batch (`done` of `steps` scored): its
    partial loss is no measurement, and the run stops after this step (saves, exits 0)."""

    def __init__(self, done: int, steps: int):
        super().__init__(f"validation stopped after {done} of {steps} batches")
        self.done, self.steps = done, steps


@torch.no_grad()
def validate(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    steps: int,
    device: torch.device,
    group=None,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
    pipeline=None,
    stop: Callable[[], bool] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, float]:
    """Mean token loss over the first `steps` batches of `batches`, over all ranks of `group`.

    `batches` yields dicts with "inputs", "targets" and optionally "positions" (where tokens sit
    in their documents: block_causal masks, per-document positions); iterating it again must start over, so every validation sees the same
    data. Every rank must yield the same number of batches (sharded models run collectives in
    forward); `group` is the data-parallel group only: ranks that hold the same batch (tp, cp,
    pp peers) must not count it twice. The model is put in eval mode and returned to its
    previous mode.
    With pipeline parallelism, `pipeline` (torchllm.parallel.Pipeline) runs the batches through
    the stages and returns their summed loss on every pp rank.
    Returns TensorBoard-ready scalars: val/loss (token-weighted mean), val/perplexity, val/tokens.
    `stop()` is asked before each batch (every rank must give the same answer: agreed over the
    ranks); when true, ValidationStopped is raised. `progress(done, steps)` is called after each
    batch.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, token count)
    try:
        for done, batch in zip(range(steps), batches):
            if stop is not None and stop():
                raise ValidationStopped(done, steps)
            if progress is not None and done:
                progress(done, steps)
            inputs = batch["inputs"].to(device, non_blocking=True)
            targets = batch["targets"].to(device, non_blocking=True)
            if pipeline is not None:
                positions = batch.get("positions")
                positions = None if positions is None else positions.to(device)
                totals[0] += pipeline.eval_loss(inputs, targets, positions, autocast).double()
                totals[1] += (targets != IGNORE_INDEX).sum()
                continue
            layout = TokenLayout.from_positions(batch.get("positions")).to(device)
            with autocast():
                logits = model(inputs, layout=layout)
            totals[0] += fused_cross_entropy_sum(logits, targets).double()
            totals[1] += (targets != IGNORE_INDEX).sum()
    finally:
        model.train(was_training)
    loss_sum, tokens = sum_over_ranks(totals, group).tolist()
    if tokens == 0:
        raise ValueError("validation saw no target tokens; the validation split is empty")
    loss = loss_sum / tokens
    return {"val/loss": loss, "val/perplexity": math.exp(min(loss, 50.0)), "val/tokens": tokens}
