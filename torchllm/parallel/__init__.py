"""Parallel dimensions and the functions that apply them to a model."""

from torchllm.parallel.dims import ParallelDims

__all__ = ["ParallelDims"]
