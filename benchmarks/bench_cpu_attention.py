"""CPU causal attention: SDPA's flash kernel vs attention built from batched matmuls by blocks.

    python benchmarks/bench_cpu_attention.py [--dtypes fp32,bf16] [--blocks 64,128,256]
        [--json OUT.json]

The blocked version takes `block` query rows at a time against keys 0..end of the block (the
causal upper triangle is skipped: at 4 blocks, 5/8 of the full square's work), with float32
softmax statistics and a flash-style backward that recomputes each block's probabilities from
the saved log-sum-exp. Every product is a plain batched matmul, so it runs at the BLAS peak of
the dtype; the question is whether that beats the flash kernel's fused loops on this CPU
(docs/performance.md: it did not in fp32 on an Intel Xeon; bf16 on a CPU whose bf16 matmuls are
4x fp32 is the open case). Before timing, both are checked against each other in float64.
Forward and backward times are the best of several runs, in ms.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# (batch, seq, heads, kv heads, head dim): the throughput benchmark's small / debug / 125M
# attention shapes, a long sequence, and grouped-query attention.
SHAPES = [(4, 512, 8, 8, 64), (8, 256, 4, 4, 64), (4, 256, 12, 4, 64), (1, 2048, 8, 8, 64),
          (4, 512, 8, 2, 64)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _block_scores(q, k, s0, s1, scale, tri):
    """(the block's queries [B, G, R*T, D], its causal scores [B, G, R*T, s1], in float32 or
    the inputs' dtype where that is wider)."""
    B, G, R, _, D = q.shape
    T = s1 - s0
    qb = q[:, :, :, s0:s1].reshape(B, G, R * T, D)
    stats = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(qb, k[:, :, :s1].transpose(-1, -2)).to(stats).mul_(scale)
    scores.view(B, G, R, T, s1)[..., s0:s1].add_(tri[:T, :T])  # the diagonal square only
    return qb, scores


class BlockedCausal(torch.autograd.Function):
    """q [B, G, R, S, D] (G KV heads with R query heads each), k, v [B, G, S, D]."""

    @staticmethod
    def forward(ctx, q, k, v, block):
        B, G, R, S, D = q.shape
        scale = D ** -0.5
        tri = torch.full((block, block), float("-inf")).triu_(1)
        out = torch.empty_like(q)
        lse = torch.empty(B, G, R, S, 1, dtype=torch.promote_types(q.dtype, torch.float32))
        for s0 in range(0, S, block):
            s1 = min(s0 + block, S)
            T = s1 - s0
            _, p = _block_scores(q, k, s0, s1, scale, tri)
            m = p.amax(dim=-1, keepdim=True)
            p = p.sub_(m).exp_()
            total = p.sum(dim=-1, keepdim=True)
            o = torch.matmul(p.to(v.dtype), v[:, :, :s1])
            o = o.div_(total) if o.dtype == total.dtype else (o.to(total.dtype) / total).to(o.dtype)
            out[:, :, :, s0:s1] = o.view(B, G, R, T, D)
            lse[:, :, :, s0:s1] = (m + total.log_()).view(B, G, R, T, 1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.block = block
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        block = ctx.block
        B, G, R, S, D = q.shape
        scale = D ** -0.5
        tri = torch.full((block, block), float("-inf")).triu_(1)
        grad_out = grad_out.contiguous()
        acc = lse.dtype  # statistics and the key/value gradient sums
        delta = (grad_out.to(acc) * out.to(acc)).sum(dim=-1, keepdim=True)  # rowsum(dO * O)
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=acc)
        dv = torch.zeros(v.shape, dtype=acc)
        for s0 in range(0, S, block):
            s1 = min(s0 + block, S)
            T = s1 - s0
            qb, p = _block_scores(q, k, s0, s1, scale, tri)
            p = p.sub_(lse[:, :, :, s0:s1].reshape(B, G, R * T, 1)).exp_()
            dob = grad_out[:, :, :, s0:s1].reshape(B, G, R * T, D)
            dv[:, :, :s1] += torch.matmul(p.to(v.dtype).transpose(-1, -2), dob).to(acc)
            dp = torch.matmul(dob, v[:, :, :s1].transpose(-1, -2)).to(acc)
            ds = dp.sub_(delta[:, :, :, s0:s1].reshape(B, G, R * T, 1)).mul_(p).mul_(scale)
            ds = ds.to(q.dtype)
            dq[:, :, :, s0:s1] = torch.matmul(ds, k[:, :, :s1]).view(B, G, R, T, D)
            dk[:, :, :s1] += torch.matmul(ds.transpose(-1, -2), qb).to(acc)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None


def blocked(q, k, v, block: int):
    """Causal attention over [batch, seq, heads, head_dim] (k/v may have fewer heads)."""
    B, S, H, D = q.shape
    G = k.shape[2]
    qh = q.transpose(1, 2).reshape(B, G, H // G, S, D).contiguous()
    kh, vh = (t.transpose(1, 2).contiguous() for t in (k, v))
    return BlockedCausal.apply(qh, kh, vh, block).reshape(B, H, S, D).transpose(1, 2)


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
        enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)


def max_errors(block: int, shape=(2, 50, 6, 3, 8)) -> list[float]:
    """Max |blocked - SDPA| of the output and of dq, dk, dv, in float64."""
    B, S, H, G, D = shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, H, D, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(B, S, G, D, dtype=torch.float64, generator=g, requires_grad=True)
            for _ in range(2))
    grad = torch.randn(B, S, H, D, dtype=torch.float64, generator=g)
    errors = []
    ref, out = sdpa(q, k, v), blocked(q, k, v, block)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    errors.append((out - ref).abs().max().item())
    errors += [(a - b).abs().max().item() for a, b in zip(grads, ref_grads)]
    return errors


def timed(fn, q, k, v, runs: int = 5) -> tuple[float, float]:
    grad = torch.randn_like(q)
    for _ in range(2):
        fn(q, k, v).backward(grad)
    fwd = bwd = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn(q, k, v)
        t1 = time.perf_counter()
        out.backward(grad)
        t2 = time.perf_counter()
        fwd, bwd = min(fwd, t1 - t0), min(bwd, t2 - t1)
    return fwd * 1e3, bwd * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--blocks", default="64,128,256")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    blocks = [int(b) for b in args.blocks.split(",")]
    for block in blocks:
        errors = max_errors(min(block, 7))  # several blocks on the small check shape
        if max(errors) > 1e-10:
            raise SystemExit(f"blocked attention differs from SDPA in float64: {errors}")
    rows = []
    print(f"{'dtype':5s} {'B, S, H, G, D':22s} {'sdpa fwd/bwd ms':>16s} "
          + " ".join(f"{'block ' + str(b):>16s}" for b in blocks))
    for name in args.dtypes.split(","):
        for shape in SHAPES:
            B, S, H, G, D = shape
            q = torch.randn(B, S, H, D, dtype=DTYPES[name], requires_grad=True)
            k, v = (torch.randn(B, S, G, D, dtype=DTYPES[name], requires_grad=True)
                    for _ in range(2))
            row = {"dtype": name, "shape": shape, "sdpa_ms": timed(sdpa, q, k, v)}
            for b in blocks:
                row[f"block_{b}_ms"] = timed(lambda q, k, v: blocked(q, k, v, b), q, k, v)
            rows.append(row)
            cells = [f"{row[key][0]:6.1f}/{row[key][1]:6.1f}" for key in row
                     if key.endswith("_ms")]
            print(f"{name:5s} {str(shape):22s} " + " ".join(f"{c:>16s}" for c in cells),
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(),
                                               "torch": torch.__version__, "rows": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
