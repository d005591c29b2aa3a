"""data.dataset = "hf:NAME" or a named one (sources.HF_DATASETS): a Hugging Face dataset (or a
local dataset folder), streamed and tokenized on the fly (torchllm/data/hf_stream.py). The first
data.val_documents documents are the validation split; training skips them by content."""

from __future__ import annotations

from torchllm.data.hf_stream import HFStreamBatches, StreamWindows, TextPacking, text_digest
from torchllm.data.kinds.base import Context, DataKind
from torchllm.data.kinds.registry import register
from torchllm.data.sources import HF_DATASETS, load_streaming, stream_texts


@register
class HFStream(DataKind):
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

    def open_rows(self, column: str):
        return load_streaming(self.path, {"name": self.subset, "split": self.split}, self.path,
                              column, self.subset, self.split)

    def texts(self):
        return stream_texts(self, self.dcfg.text_column, self.spec)

    def first_values(self, column: str, n: int) -> list:
        """The first n rows' `column` values (reading them checks `datasets`, the dataset and
        its column here, not in a loader worker)."""
        return [v for v, _ in zip(stream_texts(self, column, self.spec), range(n))]

    def stream_windows(self, ctx: Context, column: str, pack):
        """(this rank's StreamWindows of `column`'s values packed by `pack`, the validation
        windows of the held-out first data.val_documents rows): text (`windows`) and
        conversations (chat:hf:NAME) stream through this one reader."""
        held = self.first_values(column, self.dcfg.val_documents)
        reader = StreamWindows(self.open_rows, column, self.spec, pack, ctx.seq_len,
                               ctx.dp_rank, ctx.dp_degree,
                               held_out=frozenset(text_digest(v) for v in held))
        return reader, pack.validation(held, ctx)

    def windows(self, ctx: Context):
        """(this rank's StreamWindows, the held-out first data.val_documents documents)."""
        return self.stream_windows(ctx, self.dcfg.text_column, TextPacking(ctx.tokenizer))

    def batches(self, ctx: Context):
        reader, val = self.windows(ctx)
        return HFStreamBatches(reader, ctx.batch_size), val
