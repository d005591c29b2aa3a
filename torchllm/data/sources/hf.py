"""data.dataset = "hf:NAME" or a named one (HF_DATASETS): a Hugging Face dataset (or a local
dataset folder), streamed and tokenized on the fly. The first data.val_documents documents are the
validation split; training skips them by content.

Each data-parallel rank reads its own part of the stream (`split_dataset_by_node`: whole files
per rank when the file count divides evenly, else every dp_degree-th row), and loader workers
split that part again by files. Unlike the window sources, the union of the ranks' batches is
NOT the batch a single rank would see: which rows a rank reads depends on the dp degree.
`StreamWindows` yields the stream's consecutive windows (a mixture source, `take(k)`); the text
packing's `StreamBatches` batches them when the stream is the only source. The state is the
stream's own `state_dict()` plus the not yet used tokens, so resuming continues exactly where the
last yielded batch ended.

How a row's value becomes tokens is the stream's packing (torchllm/data/packing/): text
(BOS..EOS, concatenated, a document may span windows) or conversations (chat:hf:NAME: rendered
with a chat template, whole conversations per window, the rest padding, a loss mask). The same
reader, state and resume serve both.

Validation documents are held out by content (a set of text digests), not by position: a
skip count would be divided among files once the stream is split by rank and worker.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from torchllm.data.content import files_identity
from torchllm.data.sources.base import Context, Source
from torchllm.data.sources.registry import register
from torchllm.data.sources.rows import load_streaming, stream_texts

if TYPE_CHECKING:  # (annotations only: the packings import the sources)
    from torchllm.data.packing.chat import ChatPacking
    from torchllm.data.packing.text import TextPacking


@dataclass(frozen=True)
class HFDataset:
    path: str
    subset: str | None = None
    split: str = "train"


HF_DATASETS = {
    "fineweb_edu": HFDataset("HuggingFaceFW/fineweb-edu", "sample-10BT"),
    "fineweb_edu_100b": HFDataset("karpathy/fineweb-edu-100b-shuffle"),
}


class StreamWindows:
    """Consecutive windows of seq_len + 1 tokens of one rank's part of a stream, epoch after
    epoch (each pass over the part is an epoch: `set_epoch`)."""

    sequential = True  # read in order, not by window index (torchllm.data.mixture)

    def __init__(self, open_rows: Callable, text_column: str, name: str, pack, seq_len: int,
                 dp_rank: int, dp_degree: int, held_out: frozenset[bytes]):
        """open_rows(column) -> (a streaming `datasets.IterableDataset`, the column);
        `pack`: how each row's value joins the unbatched buffers (torchllm/data/packing/)."""
        self.open_rows, self.text_column, self.name = open_rows, text_column, name
        self.pack, self.window = pack, seq_len + 1
        self.dp_rank, self.dp_degree, self.held_out = dp_rank, dp_degree, held_out
        self.state = {"epoch": 0, "stream": None, **{key: [] for key in pack.buffers}}
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
        buf = {key: list(self.state[key]) for key in self.pack.buffers}
        need = k * self.window
        while len(buf["tokens"]) < need:
            item = next(self._rows, None)
            if item is None:
                return None
            self._at = item[:2]
            self.pack.add(item[2], buf, self.window)
        epoch, stream = self.state["epoch"], self.state["stream"]
        if self._at is not None:  # datasets returns its live state object: copy it
            epoch, stream = self._at[0], copy.deepcopy(self._at[1].state_dict())
        self.state = {"epoch": epoch, "stream": stream,
                      **{key: values[need:] for key, values in buf.items()}}
        return self.pack.batch({key: torch.tensor(values[:need]).view(k, self.window)
                                for key, values in buf.items()})

    def state_dict(self) -> dict:
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = state
        self.restart()

    def describe(self) -> None:
        """Its size as a mixture source: unknown until read (torchllm.data.mixture)."""
        return None


def text_digest(value) -> bytes:
    """A stable (process-independent) fingerprint of a row's value (a document's text, or a
    conversation's messages)."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True,
                                                           ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=12).digest()


@register
class HFStream(Source):
    prefix = "hf"
    names = tuple(HF_DATASETS)
    usage, order = "hf:NAME", 3
    splits_by_name = True
    streams = True  # read in order as it arrives, never whole (chat:hf:NAME streams too)

    def __init__(self, dcfg, location: str):
        super().__init__(dcfg, location)
        entry = HF_DATASETS.get(self.spec)
        self.path = entry.path if entry else location
        self.subset = dcfg.hf_subset or (entry.subset if entry else None)
        self.split = dcfg.hf_split or (entry.split if entry else "train")

    def content_identity(self) -> str:
        """A Hub dataset by its name, subset and split (its rows arrive as a stream, never
        read whole); a local dataset folder by its files' content."""
        if Path(self.path).is_dir():
            return files_identity(sorted(p for p in Path(self.path).rglob("*") if p.is_file()))
        return f"hf:{self.path}|{self.subset}|{self.split}"

    def open_rows(self, column: str):
        return load_streaming(self.path, {"name": self.subset, "split": self.split}, self.path,
                              column, self.subset, self.split)

    def texts(self):
        return stream_texts(self, self.dcfg.text_column, self.spec)

    def first_values(self, column: str, n: int) -> list:
        """The first n rows' `column` values (reading them checks `datasets`, the dataset and
        its column here, not in a loader worker)."""
        text = column != self.dcfg.chat_column  # a conversation is a list of messages
        return [v for v, _ in zip(stream_texts(self, column, self.spec, text), range(n))]

    def stream_windows(self, ctx: Context, column: str, pack: "TextPacking | ChatPacking"):
        """(this rank's StreamWindows of `column`'s values packed by `pack`, the validation
        windows of the held-out first data.val_documents rows): text (`windows`) and
        conversations (chat:hf:NAME) stream through this one reader (the packings call it)."""
        held = self.first_values(column, self.dcfg.val_documents)
        reader = StreamWindows(self.open_rows, column, self.spec, pack, ctx.seq_len,
                               ctx.dp_rank, ctx.dp_degree,
                               held_out=frozenset(text_digest(v) for v in held))
        return reader, pack.validation(held, ctx)
