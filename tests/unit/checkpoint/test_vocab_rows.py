"""New vocabulary rows at a stage boundary are drawn as transformers' `resize_token_embeddings`
draws them (`_init_added_embeddings_weights_with_mean`: N(mean, 1e-9 x covariance of the old
rows), the mean where that is not positive definite): transformers' own function, run on the
same rows after seeding the global RNG as torchllm seeds its generator, is the oracle."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchllm.checkpoint.stage.vocab_resize import grow_rows

transformers = pytest.importorskip("transformers")


def transformers_rows(old: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    """transformers' new rows for `old`, its global RNG seeded with `seed`."""
    from transformers.modeling_utils import PreTrainedModel

    old_emb = nn.Embedding(*old.shape)
    new_emb = nn.Embedding(rows, old.shape[1])
    with torch.no_grad():
        old_emb.weight.copy_(old)
        new_emb.weight[: len(old)] = old
    torch.manual_seed(seed)
    init = PreTrainedModel._init_added_embeddings_weights_with_mean  # noqa: SLF001
    init(None, old_emb, new_emb, len(old), rows - len(old))
    return new_emb.weight.detach()


@pytest.mark.parametrize("shape", [(300, 16), (12, 16)])  # covariance PD / singular (mean rows)
def test_new_rows_are_drawn_as_transformers_draws_them(shape):
    old = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.02 + 0.01
    saved = torch.cat([old, torch.zeros(3, shape[1])])  # saved rows past the vocab are dropped
    ours = grow_rows(saved, shape[0], shape[0] + 10, torch.Generator().manual_seed(7))
    theirs = transformers_rows(old, shape[0] + 10, seed=7)
    assert ours.shape == theirs.shape and torch.equal(ours[: shape[0]], old)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-7), (ours - theirs).abs().max()
    new = ours[shape[0]:]
    mean = old.double().mean(0).float()
    assert torch.allclose(new, mean.expand_as(new), atol=1e-4)  # around the mean ...
    distinct = len({tuple(r.tolist()) for r in new})
    assert distinct == (10 if shape[0] > shape[1] else 1)  # ... each its own when it can be
    # The default generator is seeded: every rank (and every run) grows the same rows.
    assert torch.equal(grow_rows(saved, shape[0], shape[0] + 10),
                       grow_rows(saved, shape[0], shape[0] + 10))
