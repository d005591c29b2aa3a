"""Apply parallelisms and speed-ups to a Llama model, in one documented order."""

from __future__ import annotations

from torch import nn

from torchllm.parallel.dims import ParallelDims


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config) -> None:
    """Single device: the model runs as built. (Multi-device apply_* functions come next.)"""
    del model, parallel_dims, job_config
