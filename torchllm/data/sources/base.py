"""The interface every data source implements, and the in-memory text sources' shared part.

A source is where a `data.dataset` spec's rows come from (local files, shards, the embedded
corpora, a Hugging Face dataset); how they become windows is the packing's (text windows or
conversations: torchllm/data/packing/), and `Dataset` (torchllm/data/dataset.py) pairs the two.
A source object is made by `parse` from one spec (no data is read then: the launcher's
pre-flight check and the trainer both parse). Then it
    * says what tokenizer it carries: `carried_tokenizer()` (shards record theirs), or gives
      the documents an 'auto' tokenizer is trained on: `texts()` (shards refuse);
    * gives its rows in one of two ways, which the packings read:
        - at hand (`streams = False`): `token_split(tokenizer)`, its text as a training and a
          validation TokenStream; `values(column, spec)`, one column of every row (local
          files: conversations);
        - streamed (`streams = True`): `stream_windows(ctx, column, pack)`, a reader of one
          rank's part of the rows as they arrive, packed by `pack`, and the held-out windows;
          `first_values(column, n)`, the first rows' values;
    * reads its tokens whole (a stream: its first max_tokens), for a dedicated validation set
      (`whole_stream`);
    * says what its content is: `content_identity()`, one string a checkpoint records, so that
      a resume knows its data position still points into the same data (torchllm.data.content:
      a full content hash of files; a streamed dataset's name, subset and split).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from torchllm.config.job_config import ConfigError
from torchllm.data.content import texts_identity
from torchllm.data.token_stream import TokenStream, pack_documents
from torchllm.log import logger


@dataclass(frozen=True)
class Batching:
    """What the data's windows and batches are, besides the [data] section: training.seq_len
    tokens each (+1 for the targets), training.local_batch_size of them per batch, shuffled by
    job.seed; the [model] section, whose document masking packed conversations must have
    (packing/chat.py: check_independent); batches pinned for a GPU (training.device)."""

    seq_len: int
    batch_size: int
    seed: int
    model: Any  # the [model] section (config.job_config.document_masking reads it)
    pin_memory: bool = False

    @classmethod
    def of(cls, training, job, model) -> "Batching":
        """The run's: from its [training], [job] and [model] sections."""
        return cls(training.seq_len, training.local_batch_size, job.seed, model,
                   training.device != "cpu" and torch.cuda.is_available())


@dataclass(frozen=True)
class Context:
    """What a dataset needs to produce windows for one data-parallel rank."""

    data: Any  # the [data] section the training data is read with (data.training_data's)
    batching: Batching
    tokenizer: Any
    dp_rank: int
    dp_degree: int
    seed: int  # the source's own seed (a mixture derives one per source from job.seed)

    @property
    def seq_len(self) -> int:
        return self.batching.seq_len

    @property
    def batch_size(self) -> int:
        return self.batching.batch_size

    def with_seed(self, seed: int) -> "Context":
        return dataclasses.replace(self, seed=seed)


class Source:
    prefix = ""  # data.dataset = "PREFIX:LOCATION"
    names: tuple[str, ...] = ()  # bare data.dataset values that are this source
    usage = ""  # how to write it, for the "is not known" error
    order = 0  # position in that error's list
    splits_by_name = False  # validation.split applies (Hugging Face datasets' named splits)
    streams = False  # rows read in order as they arrive (`stream_windows`), never whole

    def __init__(self, dcfg, location: str):
        self.dcfg, self.spec, self.location = dcfg, dcfg.dataset, location

    @classmethod
    def parse(cls, dcfg, location: str) -> "Source":
        """Check the spec without reading any data; ConfigError naming what is wrong."""
        if cls.prefix and not location:
            raise ConfigError(f"data.dataset = {dcfg.dataset!r}: give a location after "
                              f"'{cls.prefix}:' ({cls.usage})", "data.dataset")
        return cls(dcfg, location)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def preflight(self) -> None:
        """The launcher's cheap check that the data is there (local files exist); no reading."""

    def content_identity(self) -> str:
        """What this source's rows are, as one string ('files:blake2b:...', 'hf:...'): equal
        exactly when the rows are (torchllm.data.content). Every kind says its own."""
        raise NotImplementedError(f"{type(self).__name__} does not say what its content is")

    # -- tokenizer -------------------------------------------------------------------------
    def carried_tokenizer(self) -> str | None:
        """The tokenizer this data was made with, when it records one ('auto' loads it)."""
        return None

    def texts(self) -> Iterator[str]:
        """Every document's text, in order. Raises at once (not lazily) for sources without
        text."""
        raise NotImplementedError

    # -- rows at hand (streams = False) ----------------------------------------------------
    def token_split(self, tokenizer) -> tuple[TokenStream, TokenStream]:
        """(training stream, validation stream) of its documents packed as text."""
        raise NotImplementedError

    def values(self, column: str, spec: str) -> list:
        """Every row's `column` value, read whole (`spec`: the data.dataset value the user
        wrote, named in errors)."""
        raise NotImplementedError

    # -- streamed rows (streams = True) ----------------------------------------------------
    def first_values(self, column: str, n: int) -> list:
        """The first n rows' `column` values (read at start: they are checked here, not in a
        loader worker)."""
        raise NotImplementedError

    def stream_windows(self, ctx: Context, column: str, pack):
        """(this rank's reader of `column`'s values packed by `pack` (a mixture source with
        `sequential = True`), the held-out validation windows)."""
        raise NotImplementedError

    def whole_stream(self, tokenizer, max_tokens: int | None) -> TokenStream:
        """The data read whole (a dedicated validation set): documents tokenized one by one,
        all of them (max_tokens None) or until max_tokens are read."""
        more = []  # text left unread past the budget
        if max_tokens is None:
            max_tokens = sys.maxsize

        def encoded():
            total = 0
            for text in self.texts():
                if total >= max_tokens:
                    more.append(True)
                    return
                ids = tokenizer.encode(text, bos=True, eos=True)
                total += len(ids)
                yield ids

        tokens, starts = pack_documents(encoded())
        if len(tokens) == 0:
            raise ConfigError(f"{self.spec!r} has no text", "data.dataset")
        stream = TokenStream([tokens], starts, 0, min(len(tokens), max_tokens))
        stream.truncated = bool(more) or len(tokens) > max_tokens  # the run header says so
        return stream


class CorpusSource(Source):
    """Text read whole and tokenized in memory by every rank (embedded, local:); the last
    data.val_fraction of the tokens is the validation split."""

    def content_identity(self) -> str:
        """Its documents' full text (held in memory anyway); file sources hash their files."""
        return texts_identity(self.texts())

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
