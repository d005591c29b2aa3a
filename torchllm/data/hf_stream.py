"""Windows from a streaming Hugging Face dataset, tokenized on the fly.

Each data-parallel rank reads its own part of the stream (`split_dataset_by_node`: whole files
per rank when the file count divides evenly, else every dp_degree-th row), and loader workers
split that part again by files. Unlike the window sources, the union of the ranks' batches is
NOT the batch a single rank would see: which rows a rank reads depends on the dp degree.
`StreamWindows` yields the stream's consecutive windows (a mixture source, `take(k)`);
`HFStreamBatches` batches them when the stream is the only source. The state is the stream's own
`state_dict()` plus the not yet used tokens, so resuming continues exactly where the last
yielded batch ended.

Validation documents are held out by content (a set of text digests), not by position: a
skip count would be divided among files once the stream is split by rank and worker.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Callable

import torch


class StreamWindows:
    """Consecutive windows of seq_len + 1 tokens of one rank's part of a stream, epoch after
    epoch (each pass over the part is an epoch: `set_epoch`)."""

    sequential = True  # read in order, not by window index (torchllm.data.mixture)

    def __init__(self, open_rows: Callable, text_column: str, name: str, tokenizer, seq_len: int,
                 dp_rank: int, dp_degree: int, held_out: frozenset[bytes]):
        """open_rows(column) -> (a streaming `datasets.IterableDataset`, the text column)."""
        self.open_rows, self.text_column, self.name = open_rows, text_column, name
        self.tokenizer, self.window = tokenizer, seq_len + 1
        self.dp_rank, self.dp_degree, self.held_out = dp_rank, dp_degree, held_out
        self.state = {"epoch": 0, "stream": None, "tokens": [], "positions": []}
        self.restart()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_rows"] = None  # a live stream is reopened (at self.state) where it is used
        return state

    def restart(self) -> None:
        """The next `take` reopens the stream at the saved position."""
        self._rows, self._at = None, None

    def _open(self, epoch: int):
        ds, column = self.open_rows(self.text_column)  # checks datasets is there
        from datasets.distributed import split_dataset_by_node

        ds = split_dataset_by_node(ds, self.dp_rank, self.dp_degree)
        ds.set_epoch(epoch)
        return ds, column

    def _documents(self):
        """(epoch, dataset, text) of each training document from the saved position on."""
        epoch = self.state["epoch"]
        ds, column = self._open(epoch)
        resumed = self.state["stream"] is not None
        if resumed:
            ds.load_state_dict(self.state["stream"])
        while True:
            rows = 0
            for row in ds:
                rows += 1
                if self.held_out and text_digest(row[column]) in self.held_out:
                    continue
                yield epoch, ds, row[column]
            if rows == 0 and not resumed:
                if torch.utils.data.get_worker_info() is not None:
                    return  # more loader workers than files: datasets warned; the others go on
                raise RuntimeError(
                    f"data.dataset {self.name}: no documents for data-parallel rank "
                    f"{self.dp_rank} of {self.dp_degree}; the dataset needs more files or rows"
                )
            epoch, resumed = epoch + 1, False
            ds, column = self._open(epoch)

    def take(self, k: int) -> dict[str, torch.Tensor] | None:
        """The next k windows as a batch, or None when this loader worker's part is empty."""
        if self._rows is None:
            self._rows = self._documents()
        tokens, positions = list(self.state["tokens"]), list(self.state["positions"])
        need = k * self.window
        while len(tokens) < need:
            item = next(self._rows, None)
            if item is None:
                return None
            self._at = item[:2]
            ids = self.tokenizer.encode(item[2], bos=True, eos=True)
            tokens.extend(ids)
            positions.extend(range(len(ids)))
        epoch, stream = self.state["epoch"], self.state["stream"]
        if self._at is not None:  # datasets returns its live state object: copy it
            epoch, stream = self._at[0], copy.deepcopy(self._at[1].state_dict())
        self.state = {"epoch": epoch, "stream": stream, "tokens": tokens[need:],
                      "positions": positions[need:]}
        t = torch.tensor(tokens[:need]).view(k, self.window)
        p = torch.tensor(positions[:need]).view(k, self.window)
        return {"inputs": t[:, :-1], "targets": t[:, 1:], "positions": p[:, :-1]}

    def state_dict(self) -> dict:
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = state
        self.restart()


class HFStreamBatches(torch.utils.data.IterableDataset):
    """Endless batches of a stream alone: each batch is the next batch_size windows."""

    def __init__(self, reader: StreamWindows, batch_size: int):
        self.reader, self.batch_size = reader, batch_size

    def __iter__(self):
        self.reader.restart()
        while True:
            batch = self.reader.take(self.batch_size)
            if batch is None:
                return
            yield batch

    def state_dict(self) -> dict:
        return self.reader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.reader.load_state_dict(state)


def text_digest(text: str) -> bytes:
    """A stable (process-independent) fingerprint of a document's text."""
    return hashlib.blake2b(text.encode(), digest_size=12).digest()
