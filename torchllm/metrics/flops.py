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

from torchllm.log import logger
from torchllm.models.contract import LanguageModel
from torchllm.models.moe import moe_parameter_counts
from torchllm.precision import cpuinfo, matmul_flops

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


def flops_per_token(model: LanguageModel, seq_len: int) -> int:
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


def cpu_peak_cache() -> Path:
    """Where measured CPU peaks are kept: $TORCHLLM_CACHE_DIR, else ~/.cache/torchllm."""
    root = os.environ.get("TORCHLLM_CACHE_DIR") or (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchllm")
    return Path(root) / "cpu_peak_flops.json"


def cpu_peak_key(dtype: torch.dtype) -> str:
    """One machine's peak: its CPU model, the thread count and the dtype."""
    model = cpuinfo("model name", "Model", "CPU part") or platform.processor() or "unknown CPU"
    return f"{model} | {torch.get_num_threads()} threads | {str(dtype).removeprefix('torch.')}"


def cpu_peak(dtype: torch.dtype, remeasure: bool = False) -> tuple[float, str]:
    """(FLOP/s, when measured): this machine's matmul peak in `dtype`, measured once (the best
    of 10 trials of 50 ms) and cached; `remeasure` measures again and replaces the entry."""
    path, key = cpu_peak_cache(), cpu_peak_key(dtype)
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(key)
    if remeasure or not isinstance(entry, dict) or not entry.get("flops"):
        entry = {"flops": matmul_flops(dtype, trials=10, seconds=0.05),
                 "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
        cache[key] = entry
        try:  # written whole or not at all (ranks of one machine may measure at once)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("could not cache the CPU peak in %s (%s): measured again next run",
                           path, e)
    return float(entry["flops"]), str(entry.get("measured", "?"))


class CPUPeak:
    """The CPU's matmul peak in the dtype training runs in: measured once per machine (CPU
    model, thread count, dtype) and cached (`cpu_peak`), never raised to fit a step. A step
    faster than the cached peak means the peak was measured on a busy machine: MFU then reads
    over 100%, and one warning says how to measure it again."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.flops, self.measured = cpu_peak(dtype)
        self.warned = False

    def check(self, achieved: float) -> float:
        if achieved > self.flops and not self.warned:
            self.warned = True
            logger.warning(
                "MFU over 100%%: a step reached %.0f GFLOP/s, above this CPU's cached peak of "
                "%.0f GFLOP/s (%s, measured %s in %s, probably while the machine was busy); "
                "measure it again on a quiet machine: python -m torchllm.tools.cpu_peak "
                "--remeasure", achieved / 1e9, self.flops / 1e9, self.dtype, self.measured,
                cpu_peak_cache())
        return self.flops


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


class Peak:
    """The matmul peak MFU is measured against, for the dtype the matmuls run in.

    GPUs: the data sheet's dense bf16 tensor-core peak; fp32 with TF32 counts half of it (the
    TF32 peak on every device in the table); plain fp32 reports no MFU. CPUs: `CPUPeak`.
    """

    def __init__(self, device: torch.device, bf16: bool, tf32: bool = True):
        self.cpu = None
        self.flops: float | None = None
        if device.type == "cuda":
            bf16_peak = gpu_peak_flops(torch.cuda.get_device_name(device))
            if bf16_peak is not None and (bf16 or tf32):
                self.flops = bf16_peak if bf16 else bf16_peak / 2
        elif device.type == "cpu":
            self.cpu = CPUPeak(torch.bfloat16 if bf16 else torch.float32)
            self.flops = self.cpu.flops

    def check(self, achieved: float) -> float | None:
        """The peak to divide `achieved` FLOP/s by (a CPU's cached peak warns once when exceeded)."""
        if self.cpu is not None:
            self.flops = self.cpu.check(achieved)
        return self.flops


def mfu_stats(tokens_per_s_device: float, flops_per_token: int, peak: float | None) -> dict:
    """Achieved model TFLOPS per device, and MFU (%) when the peak is known."""
    achieved = tokens_per_s_device * flops_per_token
    stats = {"tflops": achieved / 1e12}
    if peak:
        stats["mfu_pct"] = 100 * achieved / peak
    return stats
