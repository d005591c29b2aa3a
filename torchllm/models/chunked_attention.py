"""Attention of a context-parallel share of the window over every key, one chunk pair at a time.

Under context parallelism (torchllm.parallel.context_parallel) the window is cut into 2·cp
chunks of `c` tokens; cp rank r holds query chunks r and 2·cp-1-r, and the keys gathered over
the cp group arrive in rank order: chunks 0, 2·cp-1, 1, 2·cp-2, ... Instead of one boolean
(S/cp x S) mask from global indices, `ChunkedMask` describes the layout and `chunked_attention`
attends each query chunk to each key chunk:

  key chunk after the query chunk   skipped (causal)
  the same chunk                    causal attention (SDPA's is_causal, no mask)
  an earlier chunk                  full attention (no mask)
  ... with documents / a window     a (c x c) block mask built for that pair only; pairs the
                                    window cannot reach are skipped

and merges the per-pair results by their log-sum-exp: out = sum_j exp(lse_j - lse) out_j with
lse = logsumexp_j lse_j. Backward recomputes each pair from the merged output and log-sum-exp
(the flash-attention backward), so what is kept for backward is q, k, v, the output and one
float per query and head: per rank O(S/cp) for queries and O(S) for the gathered keys, never
O(S²/cp). On CPU each pair runs torch's flash-attention kernel, which returns the log-sum-exp;
elsewhere it runs in float32 matmuls, a tile of query rows at a time (scores of at most
_TILE_BYTES; their block masks built per tile too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class ChunkedMask:
    """The mask of a head-tail context-parallel forward, described, not built."""

    rank: int  # this rank's position in the cp group
    degree: int  # cp ranks
    window: int = 0  # sliding window (0 = unlimited)
    q_doc: Optional[torch.Tensor] = None  # [B, Sq] document ids of the queries (block_causal)
    kv_doc: Optional[torch.Tensor] = None  # [B, Sk] those of the gathered keys

    @property
    def q_chunks(self) -> tuple[int, int]:
        """Window chunk ids of the two query chunks (in the local order)."""
        return self.rank, 2 * self.degree - 1 - self.rank

    @property
    def kv_chunks(self) -> list[int]:
        """Window chunk ids of the gathered key chunks, in order (every rank's two)."""
        return [i for r in range(self.degree) for i in (r, 2 * self.degree - 1 - r)]

    def pairs(self, c: int):
        """(query slot, key slot, causal, needs a block mask) of every pair that attends."""
        for qs, a in enumerate(self.q_chunks):
            for ks, b in enumerate(self.kv_chunks):
                if b > a or (self.window and a * c - ((b + 1) * c - 1) >= self.window):
                    continue  # in the future, or out of the window's reach
                masked = self.q_doc is not None or (
                    self.window and (a - b + 1) * c - 1 >= self.window)
                yield qs, ks, a == b, bool(masked)

    def block(self, qs: int, ks: int, c: int, device, rows: slice | None = None) -> torch.Tensor:
        """Boolean [B or 1, rows, c] mask of one pair's query `rows` (all c by default):
        causal, windowed, same document."""
        rows = rows or slice(0, c)
        a, b = self.q_chunks[qs], self.kv_chunks[ks]
        pos = torch.arange(c, device=device, dtype=torch.int32)
        diff = (pos[rows, None] - pos[None, :]) + (a - b) * c  # query index - key index
        keep = (diff >= 0)[None]
        if self.window:
            keep = keep & (diff < self.window)
        if self.q_doc is not None:
            q_doc = self.q_doc[:, qs * c:(qs + 1) * c][:, rows]
            keep = keep & (q_doc[:, :, None] == self.kv_doc[:, None, ks * c:(ks + 1) * c])
        return keep


# Scores of one tile of query rows x one key chunk on the float32 path: at most this many bytes.
_TILE_BYTES = 64 << 20


def _cpu_flash(q: torch.Tensor) -> bool:
    """Whether the pairs run torch's CPU flash-attention kernels (else float32 matmuls)."""
    return q.device.type == "cpu"


def _repeat(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    """One key chunk with its KV heads shared by n_rep query heads each (a c-token copy)."""
    return t.contiguous() if n_rep == 1 else t.repeat_interleave(n_rep, dim=1)


def _additive(keep: torch.Tensor, dtype) -> torch.Tensor:
    """Boolean [B, c, c] -> additive [B, 1, c, c] (0 kept, -inf masked) in the kernel's dtype."""
    bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    return bias.masked_fill_(~keep, float("-inf"))[:, None]


def _tiles(q: torch.Tensor, c: int):
    """Slices of query rows whose float32 scores against c keys fit in _TILE_BYTES."""
    rows = max(1, _TILE_BYTES // (4 * q.shape[0] * q.shape[1] * c))
    return [slice(r, min(c, r + rows)) for r in range(0, q.shape[2], rows)]


def _scores(q, k, keep, scale):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    return s if keep is None else s.masked_fill_(~keep[:, None], float("-inf"))


def _pair_forward(q, k, v, causal: bool, keep_rows, scale):
    """(out, lse) of q [B, H, c, D] over one key chunk; lse [B, H, c] float32, -inf where no
    key is visible. `keep_rows(rows)`: the pair's block mask of those rows, or None."""
    if _cpu_flash(q):
        keep = keep_rows(None)
        bias = None if keep is None else _additive(keep, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal and keep is None, attn_mask=bias, scale=scale)
        if keep is not None:  # rows with no visible key: no weight in the merge
            lse = lse.masked_fill(~keep.any(-1)[:, None], float("-inf"))
        return out.float(), lse
    outs, lses = [], []
    for rows in _tiles(q, k.shape[2]):  # float32 matmuls, a tile of query rows at a time
        s = _scores(q[:, :, rows], k, keep_rows(rows), scale)
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.matmul(torch.exp(s - lse[..., None]).nan_to_num_(0.0), v.float()))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _pair_backward(dout, q, k, v, out, lse, causal: bool, keep_rows, scale):
    """(dq, dk, dv) of one pair, given the merged output and log-sum-exp (flash backward)."""
    if _cpu_flash(q):
        keep = keep_rows(None)
        bias = None if keep is None else _additive(keep, q.dtype)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal and keep is None, attn_mask=bias, scale=scale)
    kf, vf = k.float(), v.float()
    dq, dk, dv = torch.empty(q.shape, device=q.device), torch.zeros_like(kf), torch.zeros_like(vf)
    for rows in _tiles(q, k.shape[2]):
        qf, dof = q[:, :, rows].float(), dout[:, :, rows].float()
        p = torch.exp(_scores(qf, kf, keep_rows(rows), scale) - lse[:, :, rows, None])
        dv += torch.matmul(p.transpose(-1, -2), dof)
        dp = torch.matmul(dof, vf.transpose(-1, -2))
        ds = p * (dp - (dof * out[:, :, rows].float()).sum(-1, keepdim=True)) * scale
        dq[:, :, rows] = torch.matmul(ds, kf)
        dk += torch.matmul(ds.transpose(-1, -2), qf)
    return dq, dk, dv


def _keep_rows(mask: ChunkedMask, qs: int, ks: int, c: int, causal: bool, masked: bool, q):
    """rows -> the pair's block mask for those query rows (None: all rows), or None where the
    pair needs none (the CPU flash kernel runs the causal diagonal with is_causal)."""
    needed = masked or (causal and not _cpu_flash(q))
    return lambda rows: mask.block(qs, ks, c, q.device, rows) if needed else None


_running = [0]  # forwards of _ChunkedAttention in progress (read by the AC policy)


def running() -> bool:
    """Whether a chunked attention's forward is computing: its kernels' outputs are its own
    scratch (it saves q, k, v, the output and the log-sum-exp), so selective AC caches none of
    them (parallel/ac.py)."""
    return _running[0] > 0


class _ChunkedAttention(torch.autograd.Function):
    """q [B, H, Sq, D], k/v [B, Hk, Sk, D] (Hk divides H) -> [B, H, Sq, D]."""

    @staticmethod
    def forward(ctx, q, k, v, mask: ChunkedMask):
        _running[0] += 1
        try:
            return _ChunkedAttention._forward(ctx, q, k, v, mask)
        finally:
            _running[0] -= 1

    @staticmethod
    def _forward(ctx, q, k, v, mask: ChunkedMask):
        c, n_rep = q.shape[2] // 2, q.shape[1] // k.shape[1]
        scale = q.shape[-1] ** -0.5
        outs = [[], []]
        for qs, ks, causal, masked in mask.pairs(c):
            kk, vv = (_repeat(t[:, :, ks * c:(ks + 1) * c], n_rep) for t in (k, v))
            outs[qs].append(_pair_forward(q[:, :, qs * c:(qs + 1) * c], kk, vv, causal,
                                          _keep_rows(mask, qs, ks, c, causal, masked, q), scale))
        merged, lses = [], []
        for parts in outs:  # merge the pairs of each query chunk by their log-sum-exp
            lse = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)
            out = sum(torch.exp(p_lse - lse)[..., None] * o.nan_to_num(0.0) for o, p_lse in parts)
            merged.append(out)
            lses.append(lse)
        out, lse = torch.cat(merged, dim=2).to(q.dtype), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.scale = mask, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        mask, scale = ctx.mask, ctx.scale
        c, n_rep = q.shape[2] // 2, q.shape[1] // k.shape[1]
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for qs, ks, causal, masked in mask.pairs(c):
            keep = _keep_rows(mask, qs, ks, c, causal, masked, q)
            qsl, ksl = slice(qs * c, (qs + 1) * c), slice(ks * c, (ks + 1) * c)
            kk, vv = (_repeat(t[:, :, ksl], n_rep) for t in (k, v))
            gq, gk, gv = _pair_backward(dout[:, :, qsl], q[:, :, qsl].contiguous(), kk, vv,
                                        out[:, :, qsl].contiguous(), lse[:, :, qsl].contiguous(),
                                        causal, keep, scale)
            dq[:, :, qsl] += gq
            shape = (k.shape[0], k.shape[1], n_rep, c, k.shape[3])  # sum the shared KV heads
            dk[:, :, ksl] += gk.float().view(shape).sum(2)
            dv[:, :, ksl] += gv.float().view(shape).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: ChunkedMask) -> torch.Tensor:
    """Attention of a head-tail share's queries [B, H, Sq, D] over the gathered keys/values
    [B, Hk, Sk, D] as `mask` describes (see the module doc); [B, H, Sq, D]."""
    return _ChunkedAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), mask)


__all__ = ["ChunkedMask", "chunked_attention"]
