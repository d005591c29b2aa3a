"""Attention masks and kernels against independent references: each document run on its own,
a brute-force per-query softmax, and explicitly repeated KV heads."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest import build_model, tiny_args
from torchllm.config import ConfigError, load_config
from torchllm.models import model_args
from torchllm.models.attention import (
    CAUSAL,
    TokenLayout,
    attend,
    build_masks,
    dense_mask,
    document_ids,
)
from torchllm.models.gpt2.args import GPT2Args
from torchllm.models.gpt2.model import GPT2
from torchllm.models.llama.args import LlamaArgs
from torchllm.models.llama.model import Transformer

from messages import raises_naming


def reference_attention(q, k, v, visible):
    """Per query, a softmax over the keys visible(b, i, j) says it sees; repeated KV heads."""
    bsz, sq, heads, dim = q.shape
    n_rep = heads // k.shape[2]
    k, v = (t.repeat_interleave(n_rep, dim=2) for t in (k, v))
    out = torch.zeros_like(q)
    for b in range(bsz):
        for i in range(sq):
            keys = [j for j in range(k.shape[1]) if visible(b, i, j)]
            s = torch.einsum("hd,jhd->hj", q[b, i], k[b, keys]) / math.sqrt(dim)
            out[b, i] = torch.einsum("hj,jhd->hd", s.softmax(-1), v[b, keys])
    return out


def qkv(bsz=2, seq=12, heads=4, kv_heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(bsz, seq, heads, dim, generator=g),
            torch.randn(bsz, seq, kv_heads, dim, generator=g),
            torch.randn(bsz, seq, kv_heads, dim, generator=g))


# Two windows of packed documents: [5 | 4 | 3] and [a continued document 2 | 7 | 3].
POSITIONS = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2],
                          [7, 8, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]])


@pytest.mark.parametrize("window", [0, 3])
def test_masks_equal_brute_force_attention(window):
    """Causal, sliding window and block-causal masks, GQA: SDPA equals the per-query softmax."""
    q, k, v = qkv()
    docs = document_ids(POSITIONS)
    idx = torch.arange(12)
    for doc in (None, docs):
        masks = build_masks([window], 12, "cpu", layout=TokenLayout(doc_ids=doc),
                            mask_type="causal" if doc is None else "block_causal")

        def visible(b, i, j):
            same_doc = doc is None or bool(doc[b, i] == doc[b, j])
            return j <= i and (not window or i - j < window) and same_doc

        expected = reference_attention(q, k, v, visible)
        torch.testing.assert_close(attend(q, k, v, masks[window]), expected, atol=1e-5, rtol=1e-5)
        dense = dense_mask(idx, idx, window, doc, doc)
        assert dense.shape == (1 if doc is None else 2, 1, 12, 12)


def test_gqa_uses_enable_gqa_on_cpu_and_matches_repeated_heads(monkeypatch):
    """Grouped-query attention without copying K/V on CPU, equal to repeating the heads."""
    q, k, v = qkv(heads=6, kv_heads=2)
    for t in (q, k, v):
        t.requires_grad_(True)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(3, 2).transpose(1, 2),
        v.repeat_interleave(3, 2).transpose(1, 2), is_causal=True).transpose(1, 2)
    ref_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    calls = []
    original = torch.Tensor.repeat_interleave
    monkeypatch.setattr(torch.Tensor, "repeat_interleave",
                        lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    mask = build_masks([2], 12, "cpu")[2]
    for m in (CAUSAL, mask):
        out = attend(q, k, v, m)
        if m is CAUSAL:
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
            grads = torch.autograd.grad(out.square().sum(), (q, k, v))
            for got, ref in zip(grads, ref_grads):
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert calls == [], "K/V were copied with repeat_interleave on CPU"


def _split_docs(positions_row):
    """[(start, end)] of the documents of one window."""
    starts = [i for i, p in enumerate(positions_row.tolist()) if p == 0 or i == 0]
    return list(zip(starts, starts[1:] + [len(positions_row)]))


@pytest.mark.parametrize("family", ["llama3", "gpt2"])
def test_block_causal_equals_each_document_alone(family):
    """Logits and gradients of a packed block_causal forward = each document run on its own
    (RoPE / learned positions restarting at each document)."""
    if family == "llama3":
        args = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                         max_seq_len=16, attn_mask_type="block_causal",
                         restart_positions_per_document=True)
        cls = Transformer
    else:
        args = GPT2Args(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16,
                        attn_mask_type="block_causal", restart_positions_per_document=True)
        cls = GPT2
    packed, alone = build_model(cls, args), build_model(cls, args)
    tokens = torch.randint(0, 64, POSITIONS.shape, generator=torch.Generator().manual_seed(1))
    logits = packed(tokens, layout=TokenLayout.from_positions(POSITIONS))
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    (logits * weights).sum().backward()
    for b in range(tokens.shape[0]):
        for start, end in _split_docs(POSITIONS[b]):
            # Alone, with the document's own positions (row 2 starts mid-document at 7).
            own = TokenLayout.from_positions(POSITIONS[b : b + 1, start:end])
            doc_logits = alone(tokens[b : b + 1, start:end], layout=own)
            torch.testing.assert_close(logits[b : b + 1, start:end], doc_logits,
                                       atol=1e-5, rtol=1e-5)
            (doc_logits * weights[b : b + 1, start:end]).sum().backward()
    grads = dict(alone.named_parameters())
    for name, p in packed.named_parameters():
        # float32 sums of many terms: the absolute tolerance follows the gradient's scale (the
        # tied table's reaches ~700 here, where one rounding of the sum order is ~1e-4).
        scale = max(1.0, p.grad.abs().max().item())
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-6 * scale + 1e-5, rtol=1e-4)


def test_llama_block_causal_needs_no_position_restart():
    """RoPE is relative: block_causal with window positions equals documents run alone too."""
    args = LlamaArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16,
                     attn_mask_type="block_causal")
    model = build_model(Transformer, args)
    tokens = torch.randint(0, 64, POSITIONS.shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(tokens, layout=TokenLayout.from_positions(POSITIONS))
        for start, end in _split_docs(POSITIONS[0]):
            torch.testing.assert_close(logits[:1, start:end], model(tokens[:1, start:end]),
                                       atol=1e-4, rtol=1e-4)
        # Plain causal attention does see across documents (the mask above is not a no-op).
        causal = dataclasses.replace(args, attn_mask_type="causal")
        other = build_model(Transformer, causal)
        full = other(tokens, layout=TokenLayout.from_positions(POSITIONS))
        assert not torch.allclose(full[:1, 5:9], model(tokens[:1, 5:9]), atol=1e-4)


def test_sliding_window_per_layer_model():
    """Per-layer windows reach each layer: window 0 = full causal, a window >= seq = causal."""
    base = LlamaArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        causal = build_model(Transformer, base)(tokens)
        wide = build_model(Transformer, dataclasses.replace(base, sliding_window=(0, 12)))(tokens)
        narrow = build_model(Transformer, dataclasses.replace(base, sliding_window=(0, 2)))(tokens)
    torch.testing.assert_close(wide, causal)
    assert torch.allclose(narrow[:, :2], causal[:, :2], atol=1e-5)  # window covers all keys
    assert not torch.allclose(narrow[:, 2:], causal[:, 2:], atol=1e-4)


def test_attention_config_errors(tmp_path):
    cfg = load_config(tiny_args(tmp_path, "--model.sliding_window=4,0"))
    with pytest.raises(ConfigError, match="model.sliding_window"):
        model_args(cfg.model, cfg.training, cfg.data)
    cfg = load_config(tiny_args(tmp_path, "--model.sliding_window=8",
                                "--model.attn_mask_type=block_causal"))
    assert model_args(cfg.model, cfg.training, cfg.data).sliding_window == (8,)
    from builders.models import layout_dims

    cfg = load_config(tiny_args(tmp_path, "--model.attention=flex"))
    with pytest.raises(ConfigError, match="model.attention = 'sdpa'"):
        layout_dims(cfg, 1, "cpu")
    cfg = load_config(tiny_args(tmp_path, "--model.name=gpt2", "--model.tie_embeddings=false",
                                "--model.restart_positions_per_document=true",
                                "--parallelism.tensor_parallel_degree=2"))
    with raises_naming(ConfigError, "tensor_parallel_degree", "GPT-2",
                       key="model.restart_positions_per_document"):
        layout_dims(cfg, 2, "cpu")


def test_train_block_causal_sliding_window(tmp_path):
    """The trainer passes document positions through: block_causal + windows train on CPU."""
    from torchllm.train import Trainer

    trainer = Trainer(load_config(tiny_args(
        tmp_path, "--model.attn_mask_type=block_causal", "--model.sliding_window=8",
        "--model.restart_positions_per_document=true", "--training.steps=3",
    )))
    losses = trainer.train()
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


def test_flex_block_mask_equals_dense_mask(monkeypatch):
    """The FlexAttention mask_mod encodes the same rule as the boolean mask (forward only, eager
    flex on CPU: training with flex needs CUDA), including keys gathered from other tokens."""
    from torch.nn.attention.flex_attention import flex_attention

    from torchllm.models import attention

    monkeypatch.setattr(attention, "_compiled_flex", lambda: flex_attention)
    q, k, v = qkv(seq=16, heads=4, kv_heads=2)
    positions = torch.cat([POSITIONS, torch.tensor([[3, 4, 5, 6], [0, 1, 0, 1]])], dim=1)
    layout = TokenLayout.from_positions(positions)
    # Queries of a head-tail share (tokens 0-3 and 12-15) over all 16 keys, as under cp = 2.
    index = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])
    local = TokenLayout(doc_ids=layout.doc_ids[:, index], index=index)

    def gather(t, dim):  # the other rank's share, then rank order: [own, other]
        other = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11])
        full = layout.doc_ids if dim == 1 else torch.arange(16)
        return torch.cat([full[:, index], full[:, other]] if dim == 1 else [index, other], dim)

    order = torch.cat([index, torch.tensor([4, 5, 6, 7, 8, 9, 10, 11])])
    for window in (0, 5):
        kwargs = dict(mask_type="block_causal", layout=local, kv_gather=gather)
        flex = build_masks([window], 8, "cpu", backend="flex", **kwargs)[window]
        dense = build_masks([window], 8, "cpu", backend="sdpa", **kwargs)[window]
        with torch.no_grad():
            got = attend(q[:, index], k[:, order], v[:, order], flex)
            expected = attend(q[:, index], k[:, order], v[:, order], dense)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        # And the dense mask under this layout is the brute-force rule on global indices.
        doc = layout.doc_ids
        ref = reference_attention(q, k, v, lambda b, i, j: j <= i and bool(doc[b, i] == doc[b, j])
                                  and (not window or i - j < window))
        torch.testing.assert_close(expected, ref[:, index], atol=1e-5, rtol=1e-5)


def test_flex_block_mask_under_cp_is_built_per_block():
    """FlexAttention under CP (rank 1's head-tail share of 2,048 queries over the 8,192 keys
    gathered from 4 ranks; documents and a window): the BlockMask equals torch's
    create_block_mask's, block for block, and building it allocates nothing of size S x S/cp
    (under 1 MiB; create_block_mask evaluated all 16.8M pairs: 16 MiB of booleans, more of
    int64 index grids)."""
    import itertools

    from torch.nn.attention.flex_attention import create_block_mask
    from torch.profiler import ProfilerActivity, profile

    from torchllm.models.attention import _mask_mod
    from torchllm.parallel.context_parallel import head_tail_index

    seq, cp = 8192, 4
    index = head_tail_index(seq, cp, 1)
    gathered = torch.cat([head_tail_index(seq, cp, r) for r in range(cp)])
    starts = torch.zeros(2, seq, dtype=torch.bool)
    starts[:, 0], starts[0, 3000], starts[1, 5000:5003] = True, True, True
    docs = torch.cumsum(starts, dim=1)  # document ids of the whole window
    local = TokenLayout(doc_ids=docs[:, index], index=index)

    def gather(t, dim):  # every rank's share in rank order
        return docs[:, gathered] if dim == 1 else gathered

    for window in (0, 1000):
        # the peak of the profiler's allocation and free events (all on this thread)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            got = build_masks([window], len(index), "cpu", mask_type="block_causal",
                              backend="flex", layout=local, kv_gather=gather)[window]
        events = sorted((e for e in prof.profiler.kineto_results.events()
                         if e.name() == "[memory]"), key=lambda e: e.start_ns())
        peak = max(itertools.accumulate(e.nbytes() for e in events))
        assert peak < 1 << 20, peak
        ref = create_block_mask(_mask_mod(index, gathered, window, docs[:, index],
                                          docs[:, gathered]), 2, None, len(index), seq)
        assert torch.equal(got.to_dense(), ref.to_dense())
        assert torch.equal(got.full_kv_num_blocks, ref.full_kv_num_blocks)
        assert got.shape == ref.shape


@pytest.mark.parametrize("flash", [True, False], ids=["cpu_flash", "float32_matmuls"])
def test_chunked_attention_equals_the_dense_mask_on_every_cp_rank(monkeypatch, flash):
    """Context parallelism's chunk pairs merged by log-sum-exp (no (S/cp x S) mask): every cp
    rank's output, and the gradients summed over the ranks, equal SDPA with the dense mask on
    the whole window; causal, sliding windows, documents, grouped-query heads, cp 1, 2, 4; with
    torch's CPU flash kernels and with the float32 matmuls other devices run (in tiles of query
    rows: uneven ones here)."""
    from torchllm.models import chunked_attention
    from torchllm.parallel.context_parallel import head_tail_index

    monkeypatch.setattr(chunked_attention, "_cpu_flash", lambda q: flash)
    monkeypatch.setattr(chunked_attention, "_TILE_BYTES", 3 * 4 * 2 * 4 * 8)  # 3-row tiles
    bsz, heads, seq, dim = 2, 4, 32, 8
    positions = torch.cat([torch.cat([POSITIONS, POSITIONS], 1)[:, :seq - 8],
                           torch.arange(8).expand(2, 8)], 1)
    for cp, window, docs, kv_heads in [(1, 0, False, 4), (2, 0, False, 2), (2, 5, False, 4),
                                       (2, 0, True, 2), (4, 12, True, 1), (4, 0, False, 4)]:
        g = torch.Generator().manual_seed(cp + window)
        q = torch.randn(bsz, heads, seq, dim, generator=g, requires_grad=True)
        k, v = (torch.randn(bsz, kv_heads, seq, dim, generator=g, requires_grad=True)
                for _ in range(2))
        doc = document_ids(positions) if docs else None
        index = torch.arange(seq)
        rep = heads // kv_heads
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
            attn_mask=dense_mask(index, index, window, doc, doc))
        grad = torch.randn(ref.shape, generator=g)
        want = torch.autograd.grad(ref, (q, k, v), grad)
        order = torch.cat([head_tail_index(seq, cp, r) for r in range(cp)])  # gathered keys
        got = [torch.zeros_like(t) for t in (q, k, v)]
        for rank in range(cp):
            mine = head_tail_index(seq, cp, rank)
            mask = chunked_attention.ChunkedMask(
                rank, cp, window, None if doc is None else doc[:, mine],
                None if doc is None else doc[:, order])
            out = chunked_attention.chunked_attention(q[:, :, mine], k[:, :, order],
                                                      v[:, :, order], mask)
            torch.testing.assert_close(out, ref[:, :, mine], atol=2e-5, rtol=2e-5)
            for total, part in zip(got, torch.autograd.grad(out, (q, k, v), grad[:, :, mine])):
                total += part
        for name, a, b in zip("qkv", got, want):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5, msg=f"cp {cp} d{name}")
