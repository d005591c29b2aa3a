"""Which device this process computes on, in which precision, seeded how."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from torchllm.config.job_config import ConfigError


def resolve_device(name: str, key: str = "training.device") -> torch.device:
    """'auto' = CUDA (this process's LOCAL_RANK GPU under torchrun) when present, else CPU.

    Asking for CUDA without it, for a GPU index beyond the visible ones (e.g. 4 processes on a
    1-GPU machine), or for an unknown device is a ConfigError naming `key`.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{key} = 'cuda' but no CUDA device is visible; use 'cpu'", key)
        local_rank, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local_rank >= count:
            raise ConfigError(
                f"{key} = 'cuda' (or 'auto'): this process has LOCAL_RANK {local_rank} but only "
                f"{count} GPU(s) are visible; launch at most {count} process(es) per node "
                "(NGPU), or use 'cpu'", key,
            )
        return torch.device("cuda", local_rank)
    if name != "cpu":
        raise ConfigError(f"{key} = {name!r}: use auto, cpu or cuda", key)
    return torch.device("cpu")


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed every RNG; optionally trade speed for bit-reproducible kernels."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; it reads this at first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False

