"""Distributed checkpointing: sharded DCP saves, exact resume, retention, conversion."""

from torchllm.checkpoint.checkpointer import Checkpointer, CheckpointSaveError
from torchllm.checkpoint.layout import complete_steps, resolve_checkpoint, step_dir
from torchllm.checkpoint.state import TrainState

__all__ = ["Checkpointer", "CheckpointSaveError", "TrainState", "complete_steps", "resolve_checkpoint", "step_dir"]
