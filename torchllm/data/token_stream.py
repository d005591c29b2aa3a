"""A split's tokens as one flat sequence, cut into packed seq_len + 1 windows.

Documents are encoded with BOS/EOS and concatenated (greedy packing: no padding). The stream is
cut into consecutive non-overlapping windows of seq_len + 1 tokens: inputs = window[:-1],
targets = window[1:], so the windows partition the stream and no token is lost or repeated
(only the tail shorter than one window is unused). `doc_starts` keeps document boundaries so
each token's position within its document is known (for cross-document attention masks).

The tokens live in one or more parts: in-memory arrays, or shard files read through memory maps
(opened lazily in each process, so a loader worker never receives a copy of a shard), or shard
objects on a store read by byte range (RangeReads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from torchllm.storage import is_url


@dataclass(frozen=True)
class ShardPart:
    """Tokens [offset, offset + length) of a file, as `dtype`, read by memory map."""

    path: str
    dtype: str
    offset: int
    length: int


class RangeReads:
    """A shard object on a store (part.path an fsspec URL), sliced like its memory map: each
    slice is one ranged read of just its bytes."""

    def __init__(self, part: ShardPart):
        from torchllm.storage import storage_for

        self.part, self.storage = part, storage_for(part.path)
        self.itemsize = np.dtype(part.dtype).itemsize

    def __getitem__(self, s: slice) -> np.ndarray:
        lo, hi, _ = s.indices(self.part.length)
        if hi <= lo:
            return np.zeros(0, self.part.dtype)
        base = self.part.offset
        data = self.storage.read_range(self.part.path, base + lo * self.itemsize,
                                       base + hi * self.itemsize)
        return np.frombuffer(data, dtype=self.part.dtype)


class TokenStream:
    truncated = False  # a validation set cut at its token budget (whole_stream)

    def __init__(self, parts: list, doc_starts: np.ndarray, start: int = 0, end: int | None = None):
        """parts: np.ndarray or ShardPart; doc_starts: sorted offsets of document starts.

        [start, end) selects a sub-range (e.g. the train or validation split) of the parts.
        """
        self.parts = parts
        lengths = [len(p) if isinstance(p, np.ndarray) else p.length for p in parts]
        self.part_starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        self.doc_starts = np.asarray(doc_starts, dtype=np.int64)
        self.start = start
        self.end = int(self.part_starts[-1]) if end is None else end
        self._open: dict[int, np.ndarray] = {}

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_open"] = {}  # memory maps are reopened in the receiving process
        return state

    def __len__(self) -> int:
        return self.end - self.start

    def split(self, at: int) -> tuple["TokenStream", "TokenStream"]:
        """(tokens [0, at), tokens [at, len)) sharing parts and document boundaries."""
        a = TokenStream(self.parts, self.doc_starts, self.start, self.start + at)
        b = TokenStream(self.parts, self.doc_starts, self.start + at, self.end)
        return a, b

    def _array(self, i: int) -> np.ndarray:
        part = self.parts[i]
        if isinstance(part, np.ndarray):
            return part
        if i not in self._open:
            self._open[i] = RangeReads(part) if is_url(part.path) else np.memmap(
                part.path, dtype=part.dtype, mode="r", offset=part.offset, shape=(part.length,))
        return self._open[i]

    def read(self, a: int, b: int) -> np.ndarray:
        """Tokens [a, b) of this stream (relative to its start) as int64."""
        a, b = a + self.start, b + self.start
        first = int(np.searchsorted(self.part_starts, a, side="right")) - 1
        out, i = [], first
        while a < b:
            lo = a - int(self.part_starts[i])
            take = min(b - a, int(self.part_starts[i + 1]) - a)
            out.append(np.asarray(self._array(i)[lo : lo + take], dtype=np.int64))
            a += take
            i += 1
        return np.concatenate(out) if len(out) != 1 else out[0]

    def positions(self, a: int, b: int) -> np.ndarray:
        """Each token's index within its document, for tokens [a, b)."""
        idx = np.arange(a + self.start, b + self.start, dtype=np.int64)
        doc = np.searchsorted(self.doc_starts, idx, side="right") - 1
        return idx - self.doc_starts[np.maximum(doc, 0)]

    def num_windows(self, window: int) -> int:
        return len(self) // window

    def window(self, i: int, window: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, positions) of window i."""
        return self.read(i * window, (i + 1) * window), self.positions(i * window, (i + 1) * window)

    def documents(self) -> int:
        """Documents that start, or continue, inside this stream's [start, end) range."""
        starts = self.doc_starts
        a = int(np.searchsorted(starts, self.start))
        inside = int(np.searchsorted(starts, self.end)) - a
        starts_on_a_boundary = a < len(starts) and starts[a] == self.start
        return inside + int(len(self) > 0 and a > 0 and not starts_on_a_boundary)

    def summary(self, window: int) -> str:
        """Its size in words (the run header): documents, tokens and windows per epoch."""
        return (f"{count(self.documents(), 'document')}, {count(len(self), 'token')} = "
                f"{count(self.num_windows(window), 'window')} of {window} tokens per epoch")

    def chunk_bounds(self, window: int) -> np.ndarray:
        """Window-index boundaries of the chunks (one per part) whose order is shuffled per epoch.

        A window belongs to the part its first token lies in.
        """
        starts = np.clip(self.part_starts - self.start, 0, len(self))
        bounds = np.minimum(-(-starts // window), self.num_windows(window))
        bounds[-1] = self.num_windows(window)
        return np.unique(np.concatenate([[0], bounds]))


def pack_documents(token_lists: Iterable[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(concatenated tokens, document start offsets) of already encoded documents."""
    lists = [t for t in token_lists if t]
    lengths = np.array([len(t) for t in lists], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lists) else np.zeros(0, np.int64)
    tokens = np.fromiter((i for t in lists for i in t), dtype=np.int64, count=int(lengths.sum()))
    return tokens, starts


def count(n: int, word: str) -> str:
    """"1 window", "2,048 windows": a count in words."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"
