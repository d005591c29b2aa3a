"""Host-device syncs per training step (issue 21, item 13): at most one, and none before the
forward. CPU stand-in for torch.cuda.set_sync_debug_mode: every op that reads a tensor value
back to Python (item / bool / int / float all dispatch `_local_scalar_dense`, plus `tolist`),
and every `torch.tensor(python data, device=...)`, which on CUDA is a blocking copy."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchllm.train import Trainer

from conftest import tiny_config
from builders.metrics import SyncRecorder, assert_one_sync_after_the_forwards, record_syncs, step_events  # noqa: F401


def test_one_host_sync_per_step_after_the_forward(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "--training.local_batch_size=2",
                                  "--training.global_batch_size=4"))  # 2 micro-steps
    events = step_events(trainer)
    assert_one_sync_after_the_forwards(events, forwards=2)
