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


QUIET_SHARE = 0.9  # of the threads' wall time this process must get for a quiet measurement


_cpu_clock, _wall_clock = time.process_time, time.perf_counter  # (this process: all threads)


def _cpu_ticks() -> tuple[int, int] | None:
    """(all CPU time, stolen time) in clock ticks since boot, from /proc/stat (None elsewhere)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(fields[:8]), fields[7] if len(fields) > 7 else 0


def measure_cpu_peak(dtype: torch.dtype, rounds: int = 3) -> dict:
    """One cache entry: the best of up to `rounds` measurements (each the best of 10 trials of
    50 ms) with how quiet the machine was around it. `share`: the CPU time this process got
    over threads x wall time (another process on our cores lowers it); `steal_pct`: the time
    the hypervisor gave other VMs; `load`: the 1-minute load average before. A round is quiet
    when share >= 0.9 and steal < 5%; the first quiet round ends the measurement."""
    threads = torch.get_num_threads()
    best: dict | None = None
    for _ in range(rounds):
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        ticks, cpu, wall = _cpu_ticks(), _cpu_clock(), _wall_clock()
        flops = matmul_flops(dtype, trials=10, seconds=0.05)
        cpu, wall = _cpu_clock() - cpu, _wall_clock() - wall
        after = _cpu_ticks()
        steal = (100 * (after[1] - ticks[1]) / max(after[0] - ticks[0], 1)
                 if ticks and after else 0.0)
        share = min(cpu / (threads * wall), 1.0) if wall > 0 else 1.0
        entry = {"flops": flops, "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "at": round(time.time()),
                 "share": round(share, 3), "steal_pct": round(steal, 1),
                 "load": None if load is None else round(load, 2),
                 "quiet": share >= QUIET_SHARE and steal < 5}
        if best is None or (entry["quiet"], flops) > (best["quiet"], best["flops"]):
            best = entry
        if entry["quiet"]:
            break
    return best


def _one_thread_peak(dtype: torch.dtype, cache: dict, remeasure: bool = False) -> dict:
    """The 1-thread entry (cached, else measured with one thread for the while)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        key = cpu_peak_key(dtype)
        entry = cache.get(key)
        if remeasure or not _usable(entry):  # (this thread count's entry, re-measured)
            entry = cache[key] = measure_cpu_peak(dtype)
        return entry
    finally:
        torch.set_num_threads(threads)


BUSY_RETRY_S = 3600  # a busy entry is measured again by the first run this long after it


def _usable(entry) -> bool:
    """A cached entry to use as is: measured quiet, or busy less than BUSY_RETRY_S ago (entries
    from before the quiet check are measured again)."""
    if not isinstance(entry, dict) or not entry.get("flops") or "quiet" not in entry:
        return False
    return entry["quiet"] is True or time.time() - entry.get("at", 0) < BUSY_RETRY_S


def _checked(dtype: torch.dtype, cache: dict) -> dict:
    """A measurement at this thread count, sane against the 1-thread peak: N threads cannot
    be slower than one (the N-thread run was disturbed: measured again; still below, the entry
    says so in `suspect` and takes the 1-thread peak as its floor), nor more than ~N times
    faster (the cached 1-thread peak was disturbed: measured again, else flagged), so that a
    DDP rank of one thread and a process of N are measured against consistent peaks."""
    entry = measure_cpu_peak(dtype)
    threads = torch.get_num_threads()
    if threads == 1:
        return entry
    single = _one_thread_peak(dtype, cache)
    if entry["flops"] < single["flops"]:
        again = measure_cpu_peak(dtype)
        entry = max(entry, again, key=lambda e: e["flops"])
    if entry["flops"] > 1.15 * threads * single["flops"]:  # the 1-thread one was disturbed:
        single = _one_thread_peak(dtype, cache, remeasure=True)  # (DDP ranks of 1 thread use it)
    if entry["flops"] > 1.15 * threads * single["flops"]:
        single.update(quiet=False, suspect=f"below 1/{threads} of the {threads}-thread peak "
                      f"({entry['flops'] / 1e9:,.0f} GFLOP/s)")
    if entry["flops"] < single["flops"]:
        entry.update(suspect=f"{threads} threads measured {entry['flops'] / 1e9:,.0f} GFLOP/s, "
                     f"below 1 thread's {single['flops'] / 1e9:,.0f}: the 1-thread peak is used",
                     flops=single["flops"], quiet=False)
    return entry


def cpu_peak_entry(dtype: torch.dtype) -> dict:
    """The cached entry of `dtype` at this thread count ({} when none)."""
    try:
        return json.loads(cpu_peak_cache().read_text()).get(cpu_peak_key(dtype)) or {}
    except (OSError, ValueError):
        return {}


def cpu_peak(dtype: torch.dtype, remeasure: bool = False) -> tuple[float, str]:
    """(FLOP/s, when measured): this machine's matmul peak in `dtype` at this thread count,
    measured (`measure_cpu_peak`, checked against the 1-thread peak) and cached; an entry
    measured on a busy machine is measured again by the first run an hour later (one from
    before the check at once), keeping the faster; `remeasure` replaces the entry."""
    path, key = cpu_peak_cache(), cpu_peak_key(dtype)
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(key)
    if remeasure or not _usable(entry):
        new = _checked(dtype, cache)
        if remeasure or not isinstance(entry, dict) or not entry.get("flops") or new["quiet"] \
                or new["flops"] > entry["flops"]:
            entry = new
        cache[key] = entry
        if not entry["quiet"]:
            logger.warning(
                "the CPU matmul peak (%s, %d threads: %.0f GFLOP/s) was measured on a busy "
                "machine (this process got %.0f%% of its threads' time, %.1f%% stolen, load "
                "%s%s): MFU is approximate; measure again on a quiet machine: python -m "
                "torchllm.tools.cpu_peak --remeasure", str(dtype).removeprefix("torch."),
                torch.get_num_threads(), entry["flops"] / 1e9, 100 * entry.get("share", 0),
                entry.get("steal_pct", 0), entry.get("load"),
                f"; {entry['suspect']}" if entry.get("suspect") else "")
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
        self.quiet = bool(cpu_peak_entry(dtype).get("quiet"))  # False: MFU is approximate
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
