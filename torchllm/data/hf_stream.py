"""Endless packed batches from a streaming Hugging Face dataset, tokenized on the fly.

Each data-parallel rank reads its own part of the stream (`split_dataset_by_node`: whole files
per rank when the file count divides evenly, else every dp_degree-th row), and loader workers
split that part again by files. Unlike the window sources, the union of the ranks' batches is
NOT the batch a single rank would see: which rows a rank reads depends on the dp degree.
The state is the stream's own `state_dict()` plus the not yet batched tokens, so resuming
continues exactly where the last yielded batch ended.

Validation documents are held out by content (a set of text digests), not by position: a
skip count would be divided among files once the stream is split by rank and worker.
"""

from __future__ import annotations

import copy
import hashlib

import torch

from torchllm.data.sources import Source, open_stream


class HFStreamBatches(torch.utils.data.IterableDataset):
    def __init__(self, source: Source, text_column: str, tokenizer, seq_len: int,
                 batch_size: int, dp_rank: int, dp_degree: int, held_out: frozenset[bytes]):
        self.source, self.text_column, self.tokenizer = source, text_column, tokenizer
        self.window, self.batch_size = seq_len + 1, batch_size
        self.dp_rank, self.dp_degree, self.held_out = dp_rank, dp_degree, held_out
        self.state = {"epoch": 0, "stream": None, "tokens": [], "positions": []}

    def _stream(self, epoch: int):
        ds, column = open_stream(self.source, self.text_column)  # checks datasets is there
        from datasets.distributed import split_dataset_by_node

        ds = split_dataset_by_node(ds, self.dp_rank, self.dp_degree)
        ds.set_epoch(epoch)
        return ds, column

    def __iter__(self):
        need = self.batch_size * self.window
        epoch = self.state["epoch"]
        tokens, positions = list(self.state["tokens"]), list(self.state["positions"])
        ds, column = self._stream(epoch)
        if self.state["stream"] is not None:
            ds.load_state_dict(self.state["stream"])
        resumed = self.state["stream"] is not None
        while True:
            rows = 0
            for row in ds:
                rows += 1
                if self.held_out and text_digest(row[column]) in self.held_out:
                    continue
                ids = self.tokenizer.encode(row[column], bos=True, eos=True)
                tokens.extend(ids)
                positions.extend(range(len(ids)))
                while len(tokens) >= need:
                    batch_t, batch_p = tokens[:need], positions[:need]
                    tokens, positions = tokens[need:], positions[need:]
                    # datasets returns its live state object: copy it, or it moves on.
                    self.state = {"epoch": epoch, "stream": copy.deepcopy(ds.state_dict()),
                                  "tokens": tokens, "positions": positions}
                    t = torch.tensor(batch_t).view(self.batch_size, self.window)
                    p = torch.tensor(batch_p).view(self.batch_size, self.window)
                    yield {"inputs": t[:, :-1], "targets": t[:, 1:], "positions": p[:, :-1]}
            if rows == 0 and not resumed:
                if torch.utils.data.get_worker_info() is not None:
                    return  # more loader workers than files: datasets warned; the others go on
                raise RuntimeError(
                    f"data.dataset {self.source.location}: no documents for data-parallel rank "
                    f"{self.dp_rank} of {self.dp_degree}; the dataset needs more files or rows"
                )
            epoch, resumed = epoch + 1, False
            ds, column = self._stream(epoch)

    def state_dict(self) -> dict:
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def text_digest(text: str) -> bytes:
    """A stable (process-independent) fingerprint of a document's text."""
    return hashlib.blake2b(text.encode(), digest_size=12).digest()
