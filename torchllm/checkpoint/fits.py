"""The features' fit checks, registered in the order a resume runs them
(torchllm/checkpoint/resume/fit.py): the global batch and the data identity on the marker,
then the vocabulary stage, LoRA and the model family on the states to read.

The checkpoint package imports this module first (torchllm/checkpoint/__init__.py), so every
program that can resume (train, the benchmarks, the tests) has them; a feature adds its check
here, and checkpoint/resume itself imports none of them.
"""

from __future__ import annotations

from torchllm.checkpoint.family import family_fit
from torchllm.checkpoint.resume.fit import register
from torchllm.checkpoint.stage.vocab_resize import vocab_fit
from torchllm.config.job_config import ConfigError
from torchllm.data.fingerprint import data_fit
from torchllm.models.lora import lora_fit


def batch_fit(fit) -> None:
    """A resume keeps the global batch its checkpoint trained with, unless allowed."""
    saved, now = fit.step.marker.get("global_batch_size"), fit.run_info.get("global_batch_size")
    if fit.resume and saved and now and saved != now and not fit.cfg.allow_global_batch_change:
        raise ConfigError(
            f"checkpoint {fit.where} was trained with a global batch of {saved} sequences, this "
            f"config makes {now}: set training.global_batch_size = {saved} to keep it "
            "(gradient accumulation makes up the difference), or "
            "checkpoint.allow_global_batch_change = true to resume with the new batch",
            "checkpoint.allow_global_batch_change")


register("batch", batch_fit, phase="marker")
register("data", data_fit, phase="marker")  # may leave the data position out
register("vocabulary", vocab_fit)
register("lora", lora_fit)
register("family", family_fit)  # last: it reads what the others changed
