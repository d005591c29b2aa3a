"""Streaming DiLoCo's fragments (fault_tolerance.num_fragments; arXiv 2501.18512): the model's
parameters in contiguous runs of blocks, each synced at its own step of the interval.

With F fragments and H = sync_steps, fragment f (0-based) syncs after H x (f + 1) / F steps of
each interval: F = 2, H = 10 syncs the first half of the blocks (and the embeddings) at steps 5,
15, 25, ... and the second half (and the final norm and output) at 10, 20, 30, ...: each sync
sends ~1/F of the parameters, every fragment still every H steps. Every fragment syncs at once
at the last step and at each checkpoint step (checkpoint.interval), the points where every
group holds the same weights.
"""

from __future__ import annotations

import re

from torchllm.config.job_config import ConfigError

_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def fragment_of(names: list[str], n: int) -> list[int]:
    """The fragment of each name (parameters or buffers, in the model's order): the blocks
    (`layers.<i>.`) in `n` contiguous runs; what comes before the first block (the
    embeddings) goes with the first fragment, what comes after (norm, output) with the last."""
    if n == 1:
        return [0] * len(names)
    block = [int(m[1]) if (m := _BLOCK.search(name)) else None for name in names]
    blocks = sorted({b for b in block if b is not None})
    if len(blocks) < n:
        raise ConfigError(f"fault_tolerance.num_fragments = {n}: the model has {len(blocks)} "
                          "blocks (model.n_layers), and each fragment is a run of at least one; "
                          f"use num_fragments <= {max(1, len(blocks))}",
                          "fault_tolerance.num_fragments")
    order = {b: i for i, b in enumerate(blocks)}
    out, seen = [], False
    for b in block:
        if b is None:
            out.append(n - 1 if seen else 0)
        else:
            seen = True
            out.append(order[b] * n // len(blocks))
    return out


def due(step: int, sync_steps: int, n: int, full: bool) -> list[int]:
    """The fragments that sync after `step` (`full`: every one, the last step or a checkpoint
    step): fragment f after sync_steps x (f + 1) / n steps of each interval."""
    if full:
        return list(range(n))
    at = step % sync_steps
    return [f for f in range(n) if at == sync_steps // n * (f + 1) % sync_steps]
