"""This CPU's matmul peak, the denominator of MFU on CPU: cached once per machine.

    python -m torchllm.tools.cpu_peak               # the cached peaks (measured if absent)
    python -m torchllm.tools.cpu_peak --remeasure   # measure again (on a quiet machine)

The cache is ~/.cache/torchllm/cpu_peak_flops.json ($TORCHLLM_CACHE_DIR overrides the folder),
one entry per CPU model, thread count and dtype (docs/metrics.md), with how quiet the machine
was (the CPU share this process got, stolen time, load; an N-thread peak is checked against the
1-thread one). A busy measurement is flagged `busy` and measured again by the first run an
hour later (docs/metrics.md); `--remeasure` measures now.
"""

from __future__ import annotations

import argparse

import torch

from torchllm.metrics.flops import cpu_peak, cpu_peak_cache, cpu_peak_entry, cpu_peak_key


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m torchllm.tools.cpu_peak",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--remeasure", action="store_true",
                        help="measure again and replace the cached values")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), action="append",
                        help="the dtype(s) (default: both)")
    args = parser.parse_args(argv)
    for name in args.dtype or ("float32", "bfloat16"):
        dtype = getattr(torch, name)
        flops, measured = cpu_peak(dtype, remeasure=args.remeasure)
        entry = cpu_peak_entry(dtype)
        state = "quiet" if entry.get("quiet") else "busy"
        print(f"{cpu_peak_key(dtype)}: {flops / 1e9:,.0f} GFLOP/s (measured {measured}, {state}: "
              f"share {entry.get('share', '?')}, steal {entry.get('steal_pct', '?')}%, load "
              f"{entry.get('load', '?')}{'; ' + entry['suspect'] if entry.get('suspect') else ''})")
    print(f"cache: {cpu_peak_cache()}")


if __name__ == "__main__":
    main()
