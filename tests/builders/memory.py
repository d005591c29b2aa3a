"""Shared test builders (tests/builders/memory.py): imported by the test modules that use them."""

from __future__ import annotations

from benchlib.worker import StepRecorder  # noqa: E402

from torchllm.tools import estimate_memory as em  # noqa: E402
from torchllm.train import Trainer  # noqa: E402

from conftest import REPO, tiny_config


def measure(tmp_path, *extra):
    # Step 2 (the measured one) must not be a logging step: those snapshot the params to
    # report update ratios, which a normal step does not hold.
    cfg = tiny_config(tmp_path, "--training.steps=3", "--metrics.log_freq=100",
                      "--metrics.enable_tensorboard=false", "--metrics.progress_bar=false", *extra)
    trainer = Trainer(cfg)
    rec = StepRecorder(trainer)
    trainer.train()
    estimate = em.estimate_memory(cfg, trainer.model_args, 1)
    return rec.tensor_memory.peak_bytes, estimate
