"""Which precision the matmuls run in, and how fast this machine runs them.

`training.mixed_precision = "auto"` means bf16 wherever bf16 matmuls are native: on CUDA, and on
a CPU that has AVX512_BF16 or AMX (and a short timed probe confirms bf16 beats fp32). CPUs
differ: on AVX-512 parts with native bf16, bf16 matmuls run ~4x faster than fp32; on AVX2-only
parts they are emulated and run 17-100x slower. So the choice is detected, never assumed.
A timing can lose to load from other processes: a CPU whose flags say native bf16 repeats the
probe before it settles for fp32, and a resumed run keeps the precision its checkpoint records
(so the same run never continues in another precision than it started in).
The loss, the optimizer and the master weights stay float32 in every case.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch
import torch.distributed as dist

# bf16 is chosen on CPU only when its matmuls are at least this much faster than fp32's.
BF16_MIN_SPEEDUP = 1.3
# Probes (each the best of 3 x 20 ms per dtype) a CPU with native bf16 flags gets before fp32.
PROBE_ATTEMPTS = 3
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpuinfo(*keys: str) -> str | None:
    """The value of the first line of Linux's /proc/cpuinfo that starts with one of `keys`
    (e.g. "model name"), or None where there is none or the file cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(keys):
            return line.split(":", 1)[1].strip()
    return None


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags (x86 "flags", ARM "Features"), or None where unknown."""
    flags = cpuinfo("flags", "Features")
    return None if flags is None else set(flags.split())


def matmul_flops(dtype: torch.dtype, size: int = 512, trials: int = 5,
                 seconds: float = 0.04) -> float:
    """This CPU's matmul FLOP/s in `dtype` with the current thread count: the best of several
    short trials, so that a moment of load from other processes does not set the number."""
    # A private generator: the peak is re-measured whenever a step beats it (timing-dependent),
    # and drawing from the global RNG would make training's random state depend on load.
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, dtype=dtype, generator=gen)
    b = torch.randn(size, size, dtype=dtype, generator=gen)
    torch.mm(a, b)  # warm-up (packing, thread pool)
    best = 0.0
    for _ in range(trials):
        n, start = 0, time.perf_counter()
        while True:
            torch.mm(a, b)
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
        best = max(best, 2 * size**3 * n / elapsed)
    return best


def _bf16_speedup(rounds: int = 3) -> float:
    """bf16 / fp32 matmul FLOP/s here: the best of `rounds` 20 ms trials per dtype, the dtypes
    alternating so that load from other processes slows both alike. (A decision, not a peak:
    native bf16 measures ~4x fp32, emulated 0.01-0.5x, both far from the threshold.)"""
    best = {torch.float32: 0.0, torch.bfloat16: 0.0}
    for _ in range(rounds):
        for dtype in best:
            best[dtype] = max(best[dtype], matmul_flops(dtype, trials=1, seconds=0.02))
    return best[torch.bfloat16] / best[torch.float32]


def _agree(native: bool) -> tuple[bool, bool]:
    """(bf16 on every rank, whether the ranks' probes disagreed): with a process group, bf16
    only if every rank measured it faster. A timing on a loaded machine can differ per rank,
    and ranks in different precisions fail in their first collective."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return native, False
    votes = torch.tensor([int(native), int(not native)])  # one all-reduce, min of both:
    dist.all_reduce(votes, op=dist.ReduceOp.MIN)  # [every rank yes, every rank no]
    every_yes, every_no = bool(votes[0]), bool(votes[1])
    return every_yes, not (every_yes or every_no)


@functools.lru_cache(maxsize=1)
def cpu_native_bf16() -> tuple[bool, str]:
    """(bf16 is native and faster here, why) — decided once per process. With a process group
    (the Trainer calls this on every rank after building its mesh) all ranks agree."""
    flags = cpu_flags()
    found = [f for f in NATIVE_BF16_FLAGS if flags and f in flags]
    if flags is not None and not found:
        native, why = False, "the CPU has no native bf16 matmul (no AVX512_BF16/AMX)"
    else:
        # Native on paper: a loaded moment can make bf16 look no faster, so probe again before
        # falling back (a CPU where bf16 really is slow measures the same every time).
        attempts = PROBE_ATTEMPTS if found else 1
        ratio = 0.0
        for attempt in range(1, attempts + 1):
            ratio = max(ratio, _bf16_speedup())
            if ratio >= BF16_MIN_SPEEDUP:
                break
        native = ratio >= BF16_MIN_SPEEDUP
        what = "/".join(f.upper() for f in found) if found else "unknown CPU flags"
        probes = f" in {attempt} probes" if attempt > 1 else ""
        why = (f"{what}; bf16 matmul measured {ratio:.1f}x fp32{probes}" if native else
               f"{what}, but bf16 matmul measured only {ratio:.2f}x fp32{probes} "
               f"(< {BF16_MIN_SPEEDUP}x)")
    agreed, split = _agree(native)
    if split:
        why += "; another rank's CPU or probe says fp32, so every rank trains in fp32"
    return agreed, why


def resolve_bf16(mixed_precision: str, device_type: str,
                 recorded: str | None = None) -> tuple[bool, str]:
    """(train in bf16, why) for training.mixed_precision on this device type.

    `recorded`: the precision ("bf16" or "fp32") the checkpoint this launch resumes from was
    trained in (the same on every rank). "auto" keeps it without probing, unless it is bf16 and
    this CPU has no native bf16 at all (the run moved to another machine); an explicit setting
    wins, and `why` says that it overrides the checkpoint's.
    """
    if mixed_precision in ("bf16", "none"):
        bf16 = mixed_precision == "bf16"
        why = f"training.mixed_precision = {mixed_precision}"
        if recorded is not None and recorded != ("bf16" if bf16 else "fp32"):
            why += f", overriding the {recorded} this run's checkpoint was trained in"
        return bf16, why
    if recorded is not None:
        if recorded == "bf16" and device_type == "cpu":
            flags = cpu_flags()
            native = flags is None or any(f in flags for f in NATIVE_BF16_FLAGS)
            agreed, _ = _agree(native)
            if not agreed:
                return False, ("auto: the checkpoint was trained in bf16, but this CPU (or "
                               "another rank's) has no native bf16 matmul (no AVX512_BF16/AMX)")
        return recorded == "bf16", (f"auto: {recorded}, as recorded in the checkpoint this run "
                                    "resumes from (kept: the probe could flip under load)")
    if device_type == "cuda":
        return True, "auto: CUDA"
    if device_type == "cpu":
        native, why = cpu_native_bf16()
        return native, f"auto: {why}"
    return False, f"auto: fp32 on {device_type}"


def use_bf16(mixed_precision: str, device_type: str) -> bool:
    return resolve_bf16(mixed_precision, device_type)[0]
