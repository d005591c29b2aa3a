"""The interface every data kind implements, and the in-memory token kinds' shared part.

A kind object is made by `parse` from one `data.dataset` spec (no data is read then: the
launcher's pre-flight check and the trainer both parse). Then it
    * says what tokenizer it needs or carries: `carried_tokenizer()` (shards record theirs),
      `texts()` (documents an 'auto' tokenizer is trained on; conversations and shards refuse),
      `chat` (its windows need a chat template);
    * yields its documents or tokens and holds out its validation part;
    * produces windows for a (dp_rank, dp_degree): `windows(ctx)` is its part of a mixture,
      `batches(ctx)` the endless batches when it is the only source; each with its validation
      windows;
    * saves and restores its position: the objects `windows` / `batches` return have
      `state_dict()` / `load_state_dict()` (a batch count for indexed sources, the stream's
      own state for streamed ones; see torchllm.data.mixture).

A mixture source is either indexed (`windows_per_epoch`, `epoch_order(epoch)`, `read(ids)`:
window j is a pure function of j) or sequential (`sequential = True`, `take(k)`, `restart()`,
`state_dict()`, `load_state_dict()`: the next k windows of a stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from torchllm.config.job_config import ConfigError
from torchllm.data.token_stream import TokenStream, pack_documents
from torchllm.data.windows import ValWindows, WindowBatches
from torchllm.log import logger


@dataclass(frozen=True)
class Context:
    """What a kind needs to produce windows for one data-parallel rank."""

    job_config: Any
    tokenizer: Any
    dp_rank: int
    dp_degree: int
    seed: int  # the source's own seed (a mixture derives one per source from job.seed)

    @property
    def seq_len(self) -> int:
        return self.job_config.training.seq_len

    @property
    def batch_size(self) -> int:
        return self.job_config.training.local_batch_size


class DataKind:
    prefix = ""  # data.dataset = "PREFIX:LOCATION"
    names: tuple[str, ...] = ()  # bare data.dataset values that are this kind
    usage = ""  # how to write it, for the "is not known" error
    order = 0  # position in that error's list
    chat = False  # conversations: the tokenizer needs a chat template (or the chat tokens)
    splits_by_name = False  # validation.split applies (Hugging Face datasets' named splits)
    wraps = False  # its location is another data spec (chat:hf:NAME reads rows through hf)
    streams = False  # rows read in order as they arrive (`stream_windows`), never whole

    def __init__(self, dcfg, location: str):
        self.dcfg, self.spec, self.location = dcfg, dcfg.dataset, location

    @classmethod
    def parse(cls, dcfg, location: str) -> "DataKind":
        """Check the spec without reading any data; ConfigError naming what is wrong."""
        if cls.prefix and not location:
            raise ConfigError(f"data.dataset = {dcfg.dataset!r}: give a location after "
                              f"'{cls.prefix}:' ({cls.usage})", "data.dataset")
        return cls(dcfg, location)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def preflight(self) -> None:
        """The launcher's cheap check that the data is there (local files exist); no reading."""

    # -- tokenizer -------------------------------------------------------------------------
    def tokenizer_source(self) -> "DataKind":
        """The source whose tokenizer the run uses (a mixture: its first)."""
        return self

    def carried_tokenizer(self) -> str | None:
        """The tokenizer this data was made with, when it records one ('auto' loads it)."""
        return None

    def texts(self) -> Iterator[str]:
        """Every document's text, in order. Raises at once (not lazily) for kinds without text."""
        raise NotImplementedError

    # -- windows ---------------------------------------------------------------------------
    def windows(self, ctx: Context):
        """(mixture source, validation windows) of this rank (module doc)."""
        raise NotImplementedError

    def batches(self, ctx: Context):
        """(endless training batches, validation windows) when this is the only source; by
        default a mixture of one (ctx.seed is then the run's, and source 0's seed derives)."""
        from torchllm.data.mixture import MixtureBatches, source_seed

        source, val = self.windows(_with_seed(ctx, source_seed(ctx.seed, 0)))
        return MixtureBatches([source], [self.spec], np.ones(1), ctx.batch_size, ctx.dp_rank,
                              ctx.dp_degree), val

    def whole_stream(self, tokenizer, max_tokens: int) -> TokenStream:
        """The first max_tokens tokens of the data read whole (a dedicated validation set):
        documents tokenized one by one until the budget is reached."""
        def encoded():
            total = 0
            for text in self.texts():
                if total >= max_tokens:
                    return
                ids = tokenizer.encode(text, bos=True, eos=True)
                total += len(ids)
                yield ids

        tokens, starts = pack_documents(encoded())
        if len(tokens) == 0:
            raise ConfigError(f"{self.spec!r} has no text", "data.dataset")
        return TokenStream([tokens], starts, 0, min(len(tokens), max_tokens))


def _with_seed(ctx: Context, seed: int) -> Context:
    return Context(ctx.job_config, ctx.tokenizer, ctx.dp_rank, ctx.dp_degree, seed)


class TokenKind(DataKind):
    """A kind whose tokens are all at hand (in memory or memory-mapped) as a train and a
    validation stream: read by window index in a seeded order per epoch."""

    def token_split(self, tokenizer) -> tuple[TokenStream, TokenStream]:
        """(training stream, validation stream)."""
        raise NotImplementedError

    def windows(self, ctx: Context):
        from torchllm.data.mixture import StreamSource

        train, val = self.token_split(ctx.tokenizer)
        source = StreamSource(train, ctx.seq_len, ctx.seed, self.dcfg.shuffle_windows, self.spec)
        return source, ValWindows(val, ctx.seq_len)

    def batches(self, ctx: Context):
        train, val = self.token_split(ctx.tokenizer)
        batches = WindowBatches(train, ctx.seq_len, ctx.batch_size, ctx.dp_rank, ctx.dp_degree,
                                ctx.seed, self.dcfg.shuffle_windows, self.spec)
        return batches, ValWindows(val, ctx.seq_len)


class CorpusKind(TokenKind):
    """Text read whole and tokenized in memory by every rank (embedded, local:); the last
    data.val_fraction of the tokens is the validation split."""

    def token_split(self, tokenizer) -> tuple[TokenStream, TokenStream]:
        tokens, starts = pack_documents(
            tokenizer.encode(text, bos=True, eos=True) for text in self.texts()
        )
        if len(tokens) == 0:
            raise ConfigError(f"data.dataset = {self.spec!r} has no text", "data.dataset")
        stream = TokenStream([tokens], starts)
        held_out = int(len(stream) * self.dcfg.val_fraction)
        if len(starts) == 1 and held_out:  # one document (a .txt file): its end is held out
            logger.info(
                "data.dataset = %r is one document: validation is its last %.3g%% (%d tokens; "
                "a book's end may be a licence or an index); a folder of files, .jsonl "
                "documents or validation.dataset hold out other text", self.spec,
                100 * self.dcfg.val_fraction, held_out)
        return stream.split(len(stream) - held_out)
