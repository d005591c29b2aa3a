"""Which device this process computes on."""

from __future__ import annotations

import os

import torch

from torchllm.config.job_config import ConfigError


def resolve_device(name: str, key: str = "training.device") -> torch.device:
    """'auto' = CUDA (this process's LOCAL_RANK GPU under torchrun) when present, else CPU.

    Asking for CUDA without it, or for an unknown device, is a ConfigError naming `key`.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{key} = 'cuda' but no CUDA device is visible; use 'cpu'", key)
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if name != "cpu":
        raise ConfigError(f"{key} = {name!r}: use auto, cpu or cuda", key)
    return torch.device("cpu")
