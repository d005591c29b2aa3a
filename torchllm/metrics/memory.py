"""Memory readings per device: CUDA allocator statistics, or the process RSS on CPU."""

from __future__ import annotations

import resource

import torch
from torch import nn

GiB = 1024**3


def rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc), else the peak from getrusage."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for `t` (a sharded DTensor's local shard, not the global size)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def training_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state on this rank.

    The three that scale with model size (16 bytes/param for fp32 AdamW): on CPU they are most of
    the RSS, and comparing them with it shows what activations and the allocator add.
    Gradients count only while they exist (read it between backward and zero_grad).
    """
    params = list(model.parameters())
    state = [
        v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    return {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(_local_bytes(t) for t in state),
    }


def memory_stats(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        total = torch.cuda.get_device_properties(device).total_memory
        active = stats.get("active_bytes.all.peak", 0)
        reserved = stats.get("reserved_bytes.all.peak", 0)
        return {
            "max_active_gib": active / GiB,
            "max_active_pct": 100 * active / total,
            "max_reserved_gib": reserved / GiB,
            "max_reserved_pct": 100 * reserved / total,
            "alloc_retries": stats.get("num_alloc_retries", 0),
            "ooms": stats.get("num_ooms", 0),
        }
    return {"rss_gib": rss_bytes() / GiB}


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
