"""Attention shared by every model family: masks (causal, block-causal, sliding window), backends
(SDPA, FlexAttention) and grouped-query attention.

A forward builds its masks once (`build_masks`), one per distinct sliding window, and each layer
calls `attend(q, k, v, mask)` with its own. What a mask is decides the kernel:

  CAUSAL          SDPA's is_causal fast path (plain causal, no window, no documents)
  None            no masking (one-token decoding)
  bool Tensor     SDPA with attn_mask [B or 1, 1, Sq, Sk] (True = attend): the CPU path that
                  trains for block_causal / sliding windows, and decoding with a KV cache
  BlockMask       FlexAttention (model.attention = "flex", CUDA only, compiled)
  ChunkedMask     context parallelism's head-tail share over the gathered keys: attended one
                  (query chunk, key chunk) pair at a time, merged by log-sum-exp; no mask
                  bigger than one pair's is ever built (models/chunked_attention.py)

Where the tokens sit is a `TokenLayout`: their position inside their document (from the data
loader), the document ids derived from it, and their index in the window (under context
parallelism a rank holds only some of the window's tokens). Keys may come from more tokens than
queries (`Transformer.kv_gather`, set by context parallelism, gathers them). A gather that names
its cp `rank` and `degree` (context_parallel.KVGather) gets a ChunkedMask; for any other the
mask is built from the global indices of both sides (FlexAttention's BlockMask block by block,
from each block's index and document range: models/flex_mask.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from torchllm.models.chunked_attention import ChunkedMask, chunked_attention
from torchllm.models.flex_mask import block_mask as flex_block_mask

MASK_TYPES = ("causal", "block_causal")
BACKENDS = ("sdpa", "flex")
CAUSAL = "causal"  # the mask value that selects SDPA's is_causal fast path

# SDPA's enable_gqa (torch >= 2.5) shares each KV head among n_rep query heads without copying.
# Kernels that take it: CPU (flash and math), CUDA flash (half precision, no attn_mask) and math.
# CUDA's memory-efficient and cuDNN kernels need equal head counts, so with a mask on CUDA the
# heads are repeated instead (else SDPA would fall back to the slow math kernel).
_SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """[B, S] position-in-document -> [B, S] document ids (a new document where position is 0).

    Ids are only compared for equality, within a window: a window that starts inside a
    document gives that document id 0.
    """
    return (positions == 0).cumsum(dim=-1)


def window_positions(positions: torch.Tensor) -> torch.Tensor:
    """[B, S] position-in-document -> the same counted from the window start for a document
    that began in an earlier window, so every position is < S (and the RoPE table covers it)."""
    index = torch.arange(positions.shape[-1], device=positions.device).expand_as(positions)
    starts = torch.where(positions == 0, index, torch.zeros_like(index))
    return index - starts.cummax(dim=-1).values


@dataclass
class TokenLayout:
    """Where a batch's tokens sit; any field may be None (= one document, window order)."""

    positions: Optional[torch.Tensor] = None  # [B, S] index in its document (window_positions)
    doc_ids: Optional[torch.Tensor] = None  # [B, S] document of each token (block_causal)
    index: Optional[torch.Tensor] = None  # [S] index of each token in the full window

    @classmethod
    def from_positions(cls, positions: torch.Tensor | None) -> "TokenLayout":
        if positions is None:
            return cls()
        return cls(positions=window_positions(positions), doc_ids=document_ids(positions))

    def to(self, device) -> "TokenLayout":
        return replace(self, **{k: None if v is None else v.to(device, non_blocking=True)
                                for k, v in vars(self).items()})


def layer_windows(sliding_window, n_layers: int) -> list[int]:
    """model.sliding_window -> one window per layer (0 = full causal attention)."""
    windows = list(sliding_window or ())
    if not windows:
        return [0] * n_layers
    if len(windows) == 1:
        return windows * n_layers
    if len(windows) != n_layers:
        raise ValueError(f"sliding_window has {len(windows)} entries for {n_layers} layers")
    return windows


def dense_mask(q_index: torch.Tensor, kv_index: torch.Tensor, window: int = 0,
               q_doc: torch.Tensor | None = None, kv_doc: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Boolean [B or 1, 1, Sq, Sk]: key j is visible to query i when it is not in the future,
    within `window` tokens (0 = unlimited) and, with document ids, in the same document."""
    diff = q_index[:, None] - kv_index[None, :]
    mask = diff >= 0
    if window:
        mask = mask & (diff < window)
    mask = mask[None]
    if q_doc is not None:
        mask = mask & (q_doc[:, :, None] == kv_doc[:, None, :])
    return mask[:, None]


def _mask_mod(q_index, kv_index, window, q_doc, kv_doc):
    """The same rule as dense_mask, as a FlexAttention mask_mod over local indices."""

    def mask_mod(b, h, q, kv):
        qi, ki = q_index[q], kv_index[kv]
        keep = ki <= qi
        if window:
            keep = keep & (qi - ki < window)
        if q_doc is not None:
            keep = keep & (q_doc[b, q] == kv_doc[b, kv])
        return keep

    return mask_mod


def build_masks(windows: list[int], seqlen: int, device, *, mask_type: str = "causal",
                backend: str = "sdpa", layout: TokenLayout | None = None,
                kv_gather: Callable | None = None) -> dict[int, object]:
    """{window: mask} for one forward over `seqlen` local tokens (see the module doc)."""
    layout = layout or TokenLayout()
    doc = layout.doc_ids if mask_type == "block_causal" else None
    plain = doc is None and layout.index is None and kv_gather is None
    if plain and backend == "sdpa" and not any(windows):
        return {0: CAUSAL}
    q_index = layout.index if layout.index is not None else torch.arange(seqlen, device=device)
    kv_index, kv_doc = q_index, doc
    # A head-tail context-parallel share (the gather names its cp rank): described, not built.
    cp_rank = getattr(kv_gather, "rank", None) if backend == "sdpa" else None
    if kv_gather is not None:
        kv_doc = None if doc is None else kv_gather(doc, 1)
        if cp_rank is None:
            kv_index = kv_gather(q_index, 0)
    masks = {}
    for w in sorted(set(windows)):
        if cp_rank is not None:  # never an (Sq x Sk) mask or index grid
            masks[w] = ChunkedMask(cp_rank, kv_gather.degree, w, doc, kv_doc)
        elif backend == "flex":  # decided per block: no (Sq x Sk) grid (models/flex_mask.py)
            masks[w] = flex_block_mask(_mask_mod(q_index, kv_index, w, doc, kv_doc), q_index,
                                       kv_index, w, doc, kv_doc)
        else:
            masks[w] = dense_mask(q_index, kv_index, w, doc, kv_doc)
    return masks


def more_keys_than_queries(mask, seqlen: int) -> bool:
    """True for a mask over gathered keys (context parallelism): gather k/v first."""
    if isinstance(mask, ChunkedMask):
        return True
    return mask is not None and not isinstance(mask, str) and mask.shape[-1] > seqlen


def decode_mask(start: int, seqlen: int, total: int, window: int, device) -> torch.Tensor | None:
    """Mask of `seqlen` new tokens at positions start.. over `total` cached keys (KV cache)."""
    if seqlen == 1 and (not window or total <= window):
        return None  # one new token sees every cached key
    return dense_mask(torch.arange(start, start + seqlen, device=device),
                      torch.arange(total, device=device), window)


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Uncompiled FlexAttention materializes the full score matrix; compiled it is a fused kernel.
    return torch.compile(flex_attention, dynamic=False)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask,
           dropout_p: float = 0.0) -> torch.Tensor:
    """Scaled dot-product attention over [batch, seq, heads, head_dim] tensors (dropout on the
    attention probabilities with SDPA; model.dropout, training only).

    k/v may have fewer heads than q (grouped-query attention) and more tokens (a KV cache, or
    keys gathered by context parallelism). Returns [batch, q_seq, q_heads, head_dim].
    """
    n_rep = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if isinstance(mask, ChunkedMask):  # context parallelism: chunk pairs, merged by LSE
        if dropout_p:
            raise ValueError("model.dropout > 0 does not run with context parallelism")
        return chunked_attention(q, k, v, mask).transpose(1, 2)
    if mask is not None and not isinstance(mask, (str, torch.Tensor)):  # a FlexAttention BlockMask
        out = _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=n_rep > 1)
        return out.transpose(1, 2)
    gqa = n_rep > 1 and _SDPA_GQA and (
        q.device.type == "cpu"
        or (mask is CAUSAL or mask is None) and q.dtype in (torch.float16, torch.bfloat16)
    )
    if n_rep > 1 and not gqa:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    kwargs = {"enable_gqa": True} if gqa else {}
    if mask is CAUSAL:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                             **kwargs)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                             **kwargs)
    return out.transpose(1, 2)
