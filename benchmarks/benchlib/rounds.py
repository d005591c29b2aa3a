"""Repeated, interleaved rounds of a benchmark's variants, and what one sitting says about them.

On a shared machine one run per variant is a coin toss (bench_parallel's FSDP2/DDP ratio read
0.97 and then 1.57 in two back-to-back runs). So each variant runs in every round, the rounds
interleaved (round 1: a, b; round 2: a, b; ...), so that a burst of load hits every variant, not
one; a row reports the median over rounds and the spread (max - min over the median), and the
machine's load average around each run. MFU on CPU is against a matmul peak measured in this
sitting (right after the rounds), at the ranks' thread count and dtype, never a peak cached on
another day.
"""

from __future__ import annotations

import os
import statistics

import torch

MIN_ROUNDS = 3


def load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def sitting_peak(dtype: torch.dtype, threads: int) -> dict:
    """This CPU's matmul peak in `dtype` at `threads` threads, measured now (not cached)."""
    from torchllm.metrics.flops import measure_cpu_peak

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        entry = measure_cpu_peak(dtype)
    finally:
        torch.set_num_threads(before)
    return {"dtype": str(dtype).removeprefix("torch."), "threads": threads,
            "flops": entry["flops"], "quiet": bool(entry.get("quiet")), "load": entry.get("load")}


def spread_pct(values: list[float]) -> float:
    """(max - min) / median, in %."""
    return 100 * (max(values) - min(values)) / statistics.median(values)


def combine(runs: list[dict], peaks: dict[tuple[str, int], float] | None = None) -> dict:
    """One variant's row from its rounds (each a `summarize` row, or a failure): the median
    round's numbers, with every round's tokens/s, the spread, and the load around each run.
    `peaks`: {(dtype, threads): FLOP/s} measured in this sitting (MFU on CPU is against it)."""
    ok = [r for r in runs if r["status"] == "ok"]
    if len(ok) < len(runs):  # a round that failed: the row says so (its reason)
        return {**next(r for r in runs if r["status"] != "ok"), "rounds": len(runs),
                "rounds_ok": len(ok)}
    speeds = [r["tokens_per_s"] for r in ok]
    median = sorted(ok, key=lambda r: r["tokens_per_s"])[(len(ok) - 1) // 2]
    row = {**median, "rounds": len(ok),
           "tokens_per_s": statistics.median(speeds),
           "tokens_per_s_device": statistics.median(r["tokens_per_s_device"] for r in ok),
           "step_time_median_s": statistics.median(r["step_time_median_s"] for r in ok),
           "tokens_per_s_rounds": speeds, "spread_pct": spread_pct(speeds),
           "load": [r.get("load") for r in ok]}
    key = (median.get("dtype"), median.get("threads"))
    if peaks and key in peaks and median.get("device") == "cpu":
        achieved = row["tokens_per_s_device"] * median["flops_per_token"]
        row.update(tflops=achieved / 1e12, mfu_pct=100 * achieved / peaks[key],
                   peak_flops=peaks[key], peak_source="measured in this sitting")
    return row
