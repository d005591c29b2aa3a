"""FlexAttention's BlockMask built block by block, never as a dense (queries x keys) mask.

torch's `create_block_mask` evaluates the mask_mod over every (query, key) pair first (a
[B, H, Sq, Sk] boolean, and int64 index grids while it does): under context parallelism Sq = S/cp
local queries over Sk = S gathered keys, an S^2/cp term per forward (at seq 262,144 and cp 8,
8 GiB of booleans). The rule here (causal over global indices, a sliding window, same document)
is decided per (query block, key block) from each block's smallest and largest index and
document id: a block pair is full when every pair in it attends, skipped when none can, and
partial otherwise (its mask_mod evaluated by the kernel, as for any partial block). What is
built is O(S/block) per side and (S/cp / block) x (S / block) block flags, as in the BlockMask
itself.
"""

from __future__ import annotations

import torch

BLOCK = 128  # FlexAttention's default block size (both sides)


def _block_range(t: torch.Tensor, n_blocks: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of each `block` consecutive entries along the last dim (the tail padded with
    its last entry's values, which do not widen a range)."""
    pad = n_blocks * block - t.shape[-1]
    if pad:
        t = torch.cat([t, t[..., -1:].expand(*t.shape[:-1], pad)], dim=-1)
    t = t.reshape(*t.shape[:-1], n_blocks, block)
    return t.amin(-1), t.amax(-1)


def _ordered(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, H, Qb, Kb] block flags -> (blocks per row, their indices first), int32."""
    num = flags.sum(-1, dtype=torch.int32)
    order = torch.argsort(flags.to(torch.int8), dim=-1, descending=True, stable=True)
    return num, order.to(torch.int32)


def block_mask(mask_mod, q_index: torch.Tensor, kv_index: torch.Tensor, window: int = 0,
               q_doc: torch.Tensor | None = None, kv_doc: torch.Tensor | None = None,
               block: int = BLOCK):
    """The BlockMask of `mask_mod` (attention._mask_mod's rule over these indices: key j
    visible to query i when kv_index[j] <= q_index[i], within `window`, in the same document)
    from per-block ranges; [B or 1, 1, ...] like create_block_mask with H = None."""
    from torch.nn.attention.flex_attention import BlockMask

    q_len, kv_len = q_index.shape[0], kv_index.shape[0]
    qb, kb = -(-q_len // block), -(-kv_len // block)
    q_lo, q_hi = (x[:, None] for x in _block_range(q_index, qb, block))
    k_lo, k_hi = (x[None, :] for x in _block_range(kv_index, kb, block))
    full = k_hi <= q_lo  # every key before every query
    some = k_lo <= q_hi  # at least one key not after the last query
    if window:
        full = full & (q_hi - k_lo < window)
        some = some & (q_lo - k_hi < window)
    full, some = full[None], some[None]  # [1, Qb, Kb]
    if q_doc is not None:
        qd_lo, qd_hi = (x[:, :, None] for x in _block_range(q_doc, qb, block))
        kd_lo, kd_hi = (x[:, None, :] for x in _block_range(kv_doc, kb, block))
        full = full & (qd_lo == qd_hi) & (kd_lo == kd_hi) & (qd_lo == kd_lo)
        some = some & (qd_lo <= kd_hi) & (kd_lo <= qd_hi)
    if (q_len % block or kv_len % block) and full.any():
        # a ragged last block is partial (the kernel masks past the sequence end)
        edge = torch.zeros_like(full[0])
        if q_len % block:
            edge[-1, :] = True
        if kv_len % block:
            edge[:, -1] = True
        full = full & ~edge
    partial = some & ~full
    kv_num, kv_idx = _ordered(partial[:, None])
    full_num, full_idx = _ordered(full[:, None])
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=mask_mod, seq_lengths=(q_len, kv_len))


__all__ = ["BLOCK", "block_mask"]
