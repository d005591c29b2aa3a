"""Batches of packed windows: the endless, resumable training order and the fixed validation order.

Training order. Epoch e is a list of all window indices: the chunks (one per shard; a single
chunk for in-memory sources) in a seeded permutation for (seed, e), and within each chunk the
windows in order, or shuffled with a seed for (seed, e, chunk) when data.shuffle_windows.
Global batch k of an epoch is entries [k·B·D, (k+1)·B·D) of that list (B = local batch size,
D = dp degree), and rank r takes the r-th block of B of them. So:
  * the ranks read disjoint windows and together cover the epoch once (only the last
    `windows mod B·D` windows of each epoch's list are skipped, different ones every epoch);
  * concatenating the ranks' batches in rank order gives exactly the batch a single rank with
    local batch size B·D gets at the same step (the parity property);
  * batch n of the run is a pure function of n, so the state is just a count.
"""

from __future__ import annotations

import numpy as np
import torch

from torchllm.config.job_config import ConfigError
from torchllm.data.token_stream import TokenStream, count


def window_batch(stream: TokenStream, window_ids, window: int) -> dict[str, torch.Tensor]:
    pairs = [stream.window(int(i), window) for i in window_ids]
    tokens = torch.from_numpy(np.stack([t for t, _ in pairs]))
    positions = torch.from_numpy(np.stack([p for _, p in pairs]))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": positions[:, :-1]}


class IndexedBatches(torch.utils.data.IterableDataset):
    """Endless batches where batch n is a pure function `batch(n)` of its index.

    With loader workers, worker w of W produces the run's batches w, w + W, ... and the
    StatefulDataLoader returns them in order. The state is the number of batches yielded.
    """

    yielded = 0

    def batch(self, n: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        while True:
            n = worker + self.yielded * workers
            self.yielded += 1
            yield self.batch(n)

    def state_dict(self) -> dict:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict) -> None:
        self.yielded = int(state["yielded"])

    def position_is_a_count(self) -> bool:
        """Whether the position is the count of batches alone, which means the same in every
        replica group (each reads its own part of the data at that count)."""
        return True


class WindowBatches(IndexedBatches):
    """Endless batches for one data-parallel rank; epochs continue inside (see module doc)."""

    def __init__(self, stream: TokenStream, seq_len: int, batch_size: int, dp_rank: int,
                 dp_degree: int, seed: int, shuffle_windows: bool, name: str):
        self.stream, self.window = stream, seq_len + 1
        self.batch_size, self.dp_rank, self.dp_degree = batch_size, dp_rank, dp_degree
        self.seed, self.shuffle_windows, self.name = seed, shuffle_windows, name
        n = stream.num_windows(self.window)
        self.batches_per_epoch = n // (batch_size * dp_degree)
        if self.batches_per_epoch == 0:
            raise ConfigError(
                f"the training split of {name} has {len(stream):,} tokens = {n} windows of "
                f"training.seq_len + 1 = {self.window}, fewer than local_batch_size x dp degree = "
                f"{batch_size * dp_degree}; use more data or lower training.seq_len / batch size"
            )
        self.chunks = stream.chunk_bounds(self.window)
        self.yielded = 0
        self._epoch, self._order = -1, None

    def epoch_order(self, epoch: int) -> np.ndarray:
        """All window indices of an epoch, in reading order (the same for every rank)."""
        rng = np.random.default_rng([self.seed, epoch])
        parts = []
        for c in rng.permutation(len(self.chunks) - 1):
            ids = np.arange(self.chunks[c], self.chunks[c + 1])
            if self.shuffle_windows:
                ids = np.random.default_rng([self.seed, epoch, int(c) + 1]).permutation(ids)
            parts.append(ids)
        return np.concatenate(parts)

    def batch(self, n: int) -> dict[str, torch.Tensor]:
        """Batch n of the run (counting from 0) for this rank."""
        epoch, k = divmod(n, self.batches_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._order = epoch, self.epoch_order(epoch)
        first = (k * self.dp_degree + self.dp_rank) * self.batch_size
        return window_batch(self.stream, self._order[first : first + self.batch_size], self.window)

    def describe(self, global_batch: int, steps: int) -> str:
        """The run header's data line: the training split's size and the epochs the run makes."""
        epochs = steps * global_batch / max(self.stream.num_windows(self.window), 1)
        return (f"{self.name}: train {self.stream.summary(self.window)}; {steps:,} steps x "
                f"{global_batch} = {epochs:.3g} epochs")


class TokenWindows:
    """A packed token stream (embedded, local:, shards:) as a mixture source: window ids in a
    seeded order per epoch (`epoch_order`), read by id (`read`)."""

    def __init__(self, stream, seq_len: int, seed: int, shuffle_windows: bool, name: str):
        # One-window batches of one rank: epoch_order is then the whole epoch's window order.
        self.order = WindowBatches(stream, seq_len, 1, 0, 1, seed, shuffle_windows, name)
        self.stream, self.window = stream, seq_len + 1
        self.windows_per_epoch = self.order.batches_per_epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        return self.order.epoch_order(epoch)

    def read(self, ids) -> dict[str, torch.Tensor]:
        return window_batch(self.stream, ids, self.window)

    def describe(self) -> str:
        """Its size as a mixture source (the run header)."""
        return self.stream.summary(self.window)


class ValWindows(torch.utils.data.Dataset):
    """The validation split's windows, all of them, in stream order. Every rank holds the same
    ones: evaluation shares out a fixed number of them over the data-parallel ranks
    (torchllm.eval.in_training.HeldOutBatches), so the held-out set does not depend on the
    layout."""

    def __init__(self, stream: TokenStream, seq_len: int):
        self.stream, self.window = stream, seq_len + 1
        self.count = stream.num_windows(self.window)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.count:
            raise IndexError(i)
        batch = window_batch(self.stream, [i], self.window)
        return {k: v[0] for k, v in batch.items()}

    def describe(self) -> str:
        """The run header's validation part: its tokens and windows."""
        return f"validation {count(len(self.stream), 'token')} ({count(self.count, 'window')})"
