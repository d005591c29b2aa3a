"""Packed next-token windows over an in-memory token stream (the embedded corpus).

Documents are encoded with BOS/EOS and concatenated; the stream is cut into non-overlapping
windows of seq_len + 1 tokens (inputs = window[:-1], targets = window[1:]). The training order
is a seeded permutation per epoch, and each data-parallel rank takes every dp_degree-th window.
"""

from __future__ import annotations

from typing import Iterator

import torch


class PackedWindows(torch.utils.data.Dataset):
    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.window = tokens, seq_len + 1
        self.n = len(tokens) // self.window

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.tokens[i * self.window : (i + 1) * self.window]
        return w[:-1], w[1:]


def train_batches(
    windows: PackedWindows, batch_size: int, seed: int, dp_rank: int, dp_degree: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, targets) batches; a new seeded permutation every epoch."""
    per_rank = len(windows) // dp_degree
    if per_rank < batch_size:
        raise ValueError(
            f"the training split has {len(windows)} windows, fewer than local_batch_size="
            f"{batch_size} per rank; lower training.seq_len or the batch size"
        )
    epoch = 0
    while True:
        order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed + epoch))
        mine = order[dp_rank::dp_degree][:per_rank]
        for start in range(0, per_rank - batch_size + 1, batch_size):
            items = [windows[int(i)] for i in mine[start : start + batch_size]]
            yield torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])
        epoch += 1
