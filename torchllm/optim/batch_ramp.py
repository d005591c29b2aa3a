"""Batch-size ramp: the global batch grows linearly in tokens, from a start value to the final one.

Small batches early make more updates from the first tokens, when the gradient noise scale is
small; later the full batch is efficient. The ramp is a pure function of the step (tokens so far
= sequences of the earlier steps x seq_len), so a resumed run takes the same batches.
"""

from __future__ import annotations

import math

from torchllm.config.job_config import ConfigError


def global_batch_size(tcfg, dp_degree: int) -> int:
    """Sequences per optimizer step: training.global_batch_size, or -1 = one pass (local batch x
    dp degree); a multiple of one pass (the rest is gradient accumulation)."""
    per_pass = tcfg.local_batch_size * dp_degree
    global_batch = per_pass if tcfg.global_batch_size == -1 else tcfg.global_batch_size
    if global_batch % per_pass:
        raise ConfigError(
            f"training.global_batch_size = {global_batch} is not a multiple of "
            f"local_batch_size ({tcfg.local_batch_size}) x data-parallel degree "
            f"({dp_degree}) = {per_pass}", "training.global_batch_size",
        )
    return global_batch


class BatchSizeRamp:
    """Global batch, micro-steps and LR multiplier of every step (1-based).

    Each step's batch is start + (final - start) x tokens_so_far / ramp_tokens, rounded down to
    a multiple of one pass (local batch x dp degree) and at least `start`; once the ramp is over
    it is the final batch. Micro-steps = batch / pass. With lr_scaling the LR is multiplied by
    sqrt(batch / final) (the square-root rule for Adam-type optimizers).
    """

    def __init__(self, tcfg, per_pass: int, final_batch: int):
        start = per_pass if tcfg.batch_size_ramp_start == -1 else tcfg.batch_size_ramp_start
        if tcfg.batch_size_ramp_tokens < 0:
            raise ConfigError(f"training.batch_size_ramp_tokens = {tcfg.batch_size_ramp_tokens}: "
                              "must be >= 0 (0 = off)", "training.batch_size_ramp_tokens")
        if tcfg.batch_size_ramp_tokens and (start < per_pass or start % per_pass
                                            or start > final_batch):
            raise ConfigError(
                f"training.batch_size_ramp_start = {start}: must be a multiple of local_batch_size"
                f" x dp degree = {per_pass}, and at most the global batch {final_batch}",
                "training.batch_size_ramp_start",
            )
        self.per_pass, self.final, self.lr_scaling = per_pass, final_batch, tcfg.batch_size_ramp_lr_scaling
        self.batches: list[int] = []  # batch of step k + 1
        tokens, ramp = 0, tcfg.batch_size_ramp_tokens
        while ramp and tokens < ramp and len(self.batches) < tcfg.steps:
            target = start + (final_batch - start) * tokens / ramp
            batch = max(start, int(target) // per_pass * per_pass)
            self.batches.append(batch)
            tokens += batch * tcfg.seq_len

    def batch(self, step: int) -> int:
        """Global batch of step `step` (1-based; 0, before the first step, counts as 1)."""
        step = max(step, 1)
        return self.batches[step - 1] if step <= len(self.batches) else self.final

    def accum_steps(self, step: int) -> int:
        return self.batch(step) // self.per_pass

    def lr_scale(self, step: int) -> float:
        return math.sqrt(self.batch(step) / self.final) if self.lr_scaling else 1.0
