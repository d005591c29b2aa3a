"""Which device this process computes on, in which precision, seeded how."""

from __future__ import annotations

import ctypes
import os
import platform
import random

import numpy as np
import torch

from torchllm import ranks
from torchllm.config.job_config import ConfigError
from torchllm.log import logger


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
        local_rank, count = ranks.local_rank(), torch.cuda.device_count()
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


def determinism_settings() -> dict:
    """torch's process-wide determinism switches (and cuBLAS's variable) as they are now, for
    `restore_determinism` (a Trainer gives them back when it closes: a notebook's next model,
    or the next test, should not inherit job.deterministic)."""
    return {
        "algorithms": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark),
        "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


def restore_determinism(saved: dict) -> None:
    torch.use_deterministic_algorithms(saved["algorithms"], warn_only=saved["warn_only"])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved["cudnn"]
    if saved["cublas_workspace"] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved["cublas_workspace"]


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



# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_memory(enabled: bool, device: torch.device) -> str:
    """On CPU with glibc, keep freed memory for reuse; returns what was done, for the log.

    glibc serves every block above its mmap threshold (at most 32 MiB) with a fresh mmap and
    unmaps it on free, so each step's logits, float32 loss buffers and their gradients (hundreds
    of MiB at a 32k vocab) are page-faulted in again, zero-filled by the kernel, every step:
    measured at ~2.5x the cost of the cross entropy itself on this project's CPU. Serving large
    blocks from the heap and never trimming it makes a step reuse the previous step's pages.
    The process keeps its peak memory (the usual steady state of a training loop).
    """
    if not enabled or device.type != "cpu":
        return ""
    if platform.libc_ver()[0] != "glibc":
        return "C library is not glibc: its allocator is left as is"
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    if libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1):
        return "freed memory is kept for reuse (training.cpu_keep_freed_memory)"
    return "mallopt refused; the C library's defaults stay"


def configure_device(device: torch.device, tcfg) -> None:
    """Process-wide settings for training on `device` (after seeding, before the model)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # TF32 keeps fp32 range with a 10-bit mantissa: ~8x faster matmuls on Ampere+.
        torch.backends.cuda.matmul.allow_tf32 = tcfg.tf32
        torch.backends.cudnn.allow_tf32 = tcfg.tf32
    if how := keep_freed_memory(tcfg.cpu_keep_freed_memory, device):
        logger.info("CPU memory: %s", how)  # no page faults on each step's large buffers
