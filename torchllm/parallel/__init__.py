"""Parallel dimensions and the functions that apply them to a model."""

from torchllm.parallel.build import build_model
from torchllm.parallel.compile import build_loss_fn
from torchllm.parallel.context_parallel import ContextParallel, apply_cp
from torchllm.parallel.dims import ParallelDims, destroy_distributed
from torchllm.parallel.first_collective import FirstCollectiveError, first_collective
from torchllm.parallel.distributed import (
    any_rank,
    clip_grad_norm_,
    dp_sum,
    gradient_sync,
    rank_zero_first,
    set_comm_timeout,
)
from torchllm.parallel.float8 import register_float8_scale_precompute
from torchllm.parallel.init import init_model_weights
from torchllm.parallel.parallelize import build_parallel_dims, parallelize_model
from torchllm.parallel.pipeline_schedule import Pipeline
from torchllm.parallel.plan import ParallelPlan

__all__ = [
    "FirstCollectiveError",
    "ContextParallel",
    "apply_cp",
    "ParallelDims",
    "ParallelPlan",
    "Pipeline",
    "any_rank",
    "build_loss_fn",
    "build_model",
    "build_parallel_dims",
    "clip_grad_norm_",
    "destroy_distributed",
    "dp_sum",
    "first_collective",
    "gradient_sync",
    "init_model_weights",
    "parallelize_model",
    "rank_zero_first",
    "register_float8_scale_precompute",
    "set_comm_timeout",
]
