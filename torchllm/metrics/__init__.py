"""Monitoring: FLOPs/MFU, memory, norms, guards, TensorBoard/W&B, progress and profiling."""

from torchllm.metrics.guard import LossGuard, TrainingStopped
from torchllm.metrics.metrics_logger import MetricsLogger
from torchllm.metrics.profiling import Profiler

__all__ = ["LossGuard", "MetricsLogger", "Profiler", "TrainingStopped"]
