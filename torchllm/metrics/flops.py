"""Model FLOPs per token and the hardware peak they are compared against (MFU)."""

from __future__ import annotations

import json
import os
import platform
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from torchllm.models.moe import moe_parameter_counts

# Dense bf16 tensor-core peaks in FLOP/s, from the vendors' data sheets (no sparsity).
PEAK_BF16_FLOPS = {
    "H100 SXM": 989e12,  # also "H100 80GB HBM3"
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H200": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "MI300X": 1307e12,
    "MI250X": 383e12,
}


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Total parameters, and those outside the input embedding table.

    For tied embeddings the table is counted once in `params` and not in `non_embedding`.
    """
    total = sum(p.numel() for p in model.parameters())
    embedding = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding)
    )
    counts = {"params": total, "non_embedding_params": total - embedding}
    moe = moe_parameter_counts(model)
    if moe["expert_params"]:  # a token uses top-k of the experts: count what it runs
        inactive = moe["expert_params"] - moe["active_expert_params"]
        counts.update(active_params=total - inactive,
                      active_non_embedding_params=total - embedding - inactive, **moe)
    return counts


def flops_per_token(model: nn.Module, seq_len: int) -> int:
    """Training FLOPs per token: 6·N + 12·L·H·Dh·T (forward + backward, attention included).

    N = non-embedding parameters (for MoE models those a token uses: top-k experts), plus the output head when it is tied to the embedding (its
    matmul runs either way, while the embedding lookup costs no FLOPs). The second term is the
    attention score and value matmuls (QKᵀ and AV), which parameters do not count; it uses the
    full T×T score matrix, as PaLM's MFU definition does, not the causal half.
    """
    args = model.args
    counts = parameter_counts(model)
    n = counts.get("active_non_embedding_params", counts["non_embedding_params"])
    if args.tie_embeddings:
        n += args.vocab_size * args.dim
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


def _cpu_cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "torchllm" / "cpu_peak_flops.json"


def measure_cpu_peak_flops(size: int = 1024, seconds: float = 0.5) -> float:
    """Measured fp32 matmul throughput of this CPU with the current thread count."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm-up
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        n += 1
    return 2 * size**3 * n / (time.perf_counter() - start)


def cpu_peak_flops() -> float:
    """The CPU's matmul peak: measured once per (CPU, thread count), then read from a cache."""
    key = f"{platform.processor() or platform.machine()}|{os.cpu_count()}|{torch.get_num_threads()}"
    path = _cpu_cache_path()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        cache[key] = measure_cpu_peak_flops()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(cache))
        except OSError:
            pass  # an unwritable cache only costs a re-measurement next time
    return cache[key]


def gpu_peak_flops(device_name: str) -> float | None:
    """Peak bf16 FLOP/s by device name, or None (with a warning) when unknown."""
    name = device_name.upper()
    if "H100" in name:
        if "NVL" in name:
            return PEAK_BF16_FLOPS["H100 NVL"]
        return PEAK_BF16_FLOPS["H100 PCIe" if "PCIE" in name else "H100 SXM"]
    for key, value in PEAK_BF16_FLOPS.items():
        if key.upper() in name:
            return value
    warnings.warn(f"unknown peak FLOPS for device {device_name!r}; MFU will not be reported")
    return None


def peak_flops(device: torch.device) -> float | None:
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device))
    return cpu_peak_flops()


def mfu_stats(tokens_per_s_device: float, flops_per_token: int, peak: float | None) -> dict:
    """Achieved model TFLOPS per device, and MFU (%) when the peak is known."""
    achieved = tokens_per_s_device * flops_per_token
    stats = {"tflops": achieved / 1e12}
    if peak:
        stats["mfu_pct"] = 100 * achieved / peak
    return stats
