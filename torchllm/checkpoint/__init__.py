"""Training checkpoints: sharded DCP saves, exact resume, retention, and the one reader that
every consumer uses (step.py). The names here are the package's public API."""

from torchllm.checkpoint.resume.checkpointer import Checkpointer
from torchllm.checkpoint.layout import (
    EXPORT_DTYPES,
    complete_steps,
    mark_complete,
    step_dir,
    step_of,
)
from torchllm.checkpoint.index import CorruptCheckpoint, UntrustedCheckpoint
from torchllm.checkpoint.step import (
    MarkerError,
    Step,
    open_checkpoint,
    read_marker,
    resolve_checkpoint,
)
from torchllm.checkpoint.resume.hparams import recorded_precision
from torchllm.checkpoint.resume.saver import CheckpointSaveError
from torchllm.checkpoint.state import TrainState
from torchllm.checkpoint.training_state import TrainingState
from torchllm.checkpoint import fits  # noqa: F401 - registers the features' resume checks

__all__ = ["EXPORT_DTYPES", "CheckpointSaveError", "Checkpointer", "CorruptCheckpoint",
           "MarkerError", "Step", "TrainState", "TrainingState", "UntrustedCheckpoint", "complete_steps",
           "mark_complete", "open_checkpoint", "read_marker", "recorded_precision",
           "resolve_checkpoint", "step_dir", "step_of"]
