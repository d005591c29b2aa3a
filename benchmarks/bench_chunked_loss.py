"""Peak memory of the loss + backward: plain float32 logits vs training.chunked_loss.

    PYTHONPATH=. python benchmarks/bench_chunked_loss.py [--vocab 131072] [--tokens 1024]
        [--dim 512] [--chunk 256] [--device cpu|cuda] [--out outputs/bench_chunked_loss.json]

Each variant computes the summed cross entropy of hidden [tokens, dim] @ weight.T [dim, vocab]
and its backward, in a fresh process (CPU: peak resident set size above the process's
baseline after the inputs exist; CUDA: peak allocated bytes above the inputs). The plain path
holds the [tokens, vocab] float32 logits, their log-softmax and their gradient; the chunked one
holds one [chunk, vocab] block at a time. Also prints the analytic size of the full logits.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from torchllm.loss import chunked_cross_entropy_sum, cross_entropy_sum


def measure(variant: str, vocab: int, tokens: int, dim: int, chunk: int, device: str) -> dict:
    """Run one variant here; returns its peak extra bytes and time."""
    torch.manual_seed(0)
    hidden = torch.randn(1, tokens, dim, device=device, requires_grad=True)
    weight = (torch.randn(vocab, dim, device=device) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (1, tokens), device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    if variant == "plain":
        loss = cross_entropy_sum(F.linear(hidden, weight), targets)
    else:
        loss = chunked_cross_entropy_sum(hidden, weight, targets, chunk)
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"variant": variant, "peak_extra_bytes": peak, "seconds": time.perf_counter() - t0,
            "loss": loss.item()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=131_072)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="outputs/bench_chunked_loss.json")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # the child process's one measurement
    a = p.parse_args()
    if a.variant:
        print(json.dumps(measure(a.variant, a.vocab, a.tokens, a.dim, a.chunk, a.device)))
        return
    rows = []
    for variant in ("plain", "chunked"):
        out = subprocess.run(
            [sys.executable, __file__, f"--variant={variant}", f"--vocab={a.vocab}",
             f"--tokens={a.tokens}", f"--dim={a.dim}", f"--chunk={a.chunk}",
             f"--device={a.device}"], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    logits_mib = a.tokens * a.vocab * 4 / 2**20
    print(f"vocab {a.vocab:,}, {a.tokens} tokens, dim {a.dim}, chunk {a.chunk}, {a.device}: "
          f"full float32 logits = {logits_mib:.0f} MiB")
    for r in rows:
        print(f"  {r['variant']:8s} peak +{r['peak_extra_bytes'] / 2**20:8.0f} MiB  "
              f"{r['seconds']:.2f} s  loss {r['loss']:.4f}")
    saving = rows[0]["peak_extra_bytes"] / max(1, rows[1]["peak_extra_bytes"])
    print(f"  chunked peak is {saving:.1f}x smaller")
    result = {"vocab": a.vocab, "tokens": a.tokens, "dim": a.dim, "chunk": a.chunk,
              "device": a.device, "full_logits_mib": logits_mib, "runs": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
