"""data.dataset = "hf:NAME" or a named one (sources.HF_DATASETS): a Hugging Face dataset (or a
local dataset folder), streamed and tokenized on the fly (torchllm/data/hf_stream.py). The first
data.val_documents documents are the validation split; training skips them by content."""

from __future__ import annotations

from torchllm.data.hf_stream import HFStreamBatches, StreamWindows, text_digest
from torchllm.data.kinds.base import Context, DataKind
from torchllm.data.kinds.registry import register
from torchllm.data.sources import HF_DATASETS, load_streaming, stream_texts
from torchllm.data.token_stream import TokenStream, pack_documents
from torchllm.data.windows import ValWindows


@register
class HFStream(DataKind):
    prefix = "hf"
    names = tuple(HF_DATASETS)
    usage, order = "hf:NAME", 3
    splits_by_name = True

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

    def windows(self, ctx: Context):
        """(this rank's StreamWindows, the held-out first data.val_documents documents)."""
        val_texts = [t for t, _ in zip(self.texts(), range(self.dcfg.val_documents))]
        # (reading them checks `datasets`, the dataset and its column here, not in a worker)
        tokens, starts = pack_documents(ctx.tokenizer.encode(t, bos=True, eos=True)
                                        for t in val_texts)
        val = TokenStream([tokens], starts)
        reader = StreamWindows(self.open_rows, self.dcfg.text_column, self.spec, ctx.tokenizer,
                               ctx.seq_len, ctx.dp_rank, ctx.dp_degree,
                               held_out=frozenset(text_digest(t) for t in val_texts))
        return reader, ValWindows(val, ctx.seq_len, ctx.dp_rank, ctx.dp_degree)

    def batches(self, ctx: Context):
        reader, val = self.windows(ctx)
        return HFStreamBatches(reader, ctx.batch_size), val
