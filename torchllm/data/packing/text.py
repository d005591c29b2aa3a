"""The text packing: documents encoded BOS..EOS and concatenated into windows of seq_len + 1
tokens (greedy: no padding, a document may span windows), each token's position within its
document kept (the document masks' input: block_causal attention and restarted positions where
model.attn_mask_type / restart_positions_per_document ask for them).

The rows come from the source either way it gives them (torchllm/data/sources/base.py): tokens
at hand are read by window index (torchllm.data.windows), a stream's windows in order as they
arrive (`StreamBatches` alone; a reader that a mixture takes windows from).
"""

from __future__ import annotations

import torch

from torchllm.data.token_stream import TokenStream, pack_documents
from torchllm.data.windows import TokenWindows, ValWindows, WindowBatches


class TextPacking:
    """Text documents: each encoded BOS..EOS and appended to one stream of tokens (a document
    may span windows); `positions` restart at 0 in each document. The class is the choice a
    Dataset makes (`windows`, `batches`, ...: class methods); an instance packs one stream's
    documents as they arrive (`add`, `batch`, `validation`)."""

    chat = False
    usage = ""  # a source's own spec (no prefix)
    buffers = ("tokens", "positions")

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def add(self, text: str, buf: dict[str, list], window: int) -> None:
        ids = self.tokenizer.encode(text, bos=True, eos=True)
        buf["tokens"].extend(ids)
        buf["positions"].extend(range(len(ids)))

    def batch(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The training batch of k whole windows ([k, seq_len + 1] per buffer)."""
        t, p = rows["tokens"], rows["positions"]
        return {"inputs": t[:, :-1], "targets": t[:, 1:], "positions": p[:, :-1]}

    def validation(self, texts: list[str], ctx):
        """The validation windows of the held-out documents."""
        tokens, starts = pack_documents(self.tokenizer.encode(t, bos=True, eos=True)
                                        for t in texts)
        return ValWindows(TokenStream([tokens], starts), ctx.seq_len)

    # -- the choice: a Dataset's windows and batches with this packing ------------------------
    @classmethod
    def texts(cls, ds):
        return ds.source.texts()

    @classmethod
    def windows(cls, ds, ctx):
        """(mixture source, validation windows) of ds's text for this rank."""
        if ds.source.streams:
            return ds.source.stream_windows(ctx, ds.dcfg.text_column, cls(ctx.tokenizer))
        train, val = ds.source.token_split(ctx.tokenizer)
        source = TokenWindows(train, ctx.seq_len, ctx.seed, ds.dcfg.shuffle_windows, ds.spec)
        return source, ValWindows(val, ctx.seq_len)

    @classmethod
    def batches(cls, ds, ctx):
        """Alone: a stream's next windows (StreamBatches), or every token at hand read by window
        index in a seeded order per epoch (WindowBatches)."""
        if ds.source.streams:
            reader, val = cls.windows(ds, ctx)
            return StreamBatches(reader, ctx.batch_size), val
        train, val = ds.source.token_split(ctx.tokenizer)
        batches = WindowBatches(train, ctx.seq_len, ctx.batch_size, ctx.dp_rank, ctx.dp_degree,
                                ctx.seed, ds.dcfg.shuffle_windows, ds.spec)
        return batches, ValWindows(val, ctx.seq_len)

    @classmethod
    def whole_stream(cls, ds, tokenizer, max_tokens: int):
        return ds.source.whole_stream(tokenizer, max_tokens)


class StreamBatches(torch.utils.data.IterableDataset):
    """Endless batches of a stream alone: each batch is the next batch_size windows."""

    def __init__(self, reader, batch_size: int):
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

    def describe(self, global_batch: int, steps: int) -> str:
        """The run header's data line: a stream's size is unknown until read."""
        return (f"{self.reader.name}: streamed (size unknown until read); {steps:,} steps x "
                f"{global_batch} windows = {steps * global_batch:,} windows")
