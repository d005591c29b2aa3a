"""What a data config reads: a dataset is a source x a packing; a mixture, several datasets.

    ds = parse_data(cfg.data)          # a Dataset, or a Mixture of [[data.sources]]
    ds.tokenizer_source()              # which dataset a data.tokenizer = 'auto' comes from
    ds.batches(ctx)                    # (endless training batches, validation windows)

A data.dataset value names a source (torchllm/data/sources/: local:PATH, shards:DIR, hf:NAME,
embedded, ...), read as text windows, or after a packing prefix the source whose rows that
packing reads ("chat:PATH", "chat:hf:NAME": conversations, torchllm/data/packing/chat.py).
Which prefix is a packing is the config's (config.job_config.data_packing: the model's document
masking follows it); which source reads a packing's location is the sources' registry's.
"""

from __future__ import annotations

import copy

from torchllm.config.job_config import CHAT, TEXT, ConfigError, data_packing
from torchllm.data.mixture import Mixture
from torchllm.data.packing.chat import ChatPacking
from torchllm.data.packing.text import TextPacking
from torchllm.data.sources import parse_source
from torchllm.data.sources.registry import rows_spec

PACKINGS = {TEXT: TextPacking, CHAT: ChatPacking}  # by config.job_config.data_packing's names


class Dataset:
    """One data.dataset value: its source read with its packing."""

    def __init__(self, dcfg, source, packing):
        self.dcfg, self.spec, self.source, self.packing = dcfg, dcfg.dataset, source, packing
        self.chat = packing.chat  # its windows need a chat template (or the chat tokens)

    def __repr__(self) -> str:
        return f"Dataset({self.spec!r}: {self.source!r} x {self.packing.__name__})"

    @classmethod
    def parse(cls, dcfg, key: str = "data.dataset") -> "Dataset":
        """The Dataset of `dcfg.dataset` (its packing, then the source it reads), its spec
        checked without reading data; `key`: the config key named by errors."""
        name, location = data_packing(dcfg.dataset)
        packing = PACKINGS[name]
        if location is None:
            more = [p.usage for p in PACKINGS.values() if p.usage]
            return cls(dcfg, parse_source(dcfg, key, tuple(more)), packing)
        if not location:
            raise ConfigError(f"data.dataset = {dcfg.dataset!r}: give a location after "
                              f"'{name}:' ({packing.usage})", "data.dataset")
        rows = copy.copy(dcfg)  # the source that reads the packing's rows, checked now too
        rows.dataset, rows.sources = rows_spec(location), []
        return cls(dcfg, parse_source(rows), packing)

    @property
    def splits_by_name(self) -> bool:
        """validation.split applies: a Hugging Face dataset read as text."""
        return self.source.splits_by_name and not self.chat

    def preflight(self) -> None:
        """The launcher's cheap check that the data is there (local files exist); no reading."""
        self.source.preflight()

    def tokenizer_source(self) -> "Dataset":
        return self

    def content_identity(self) -> list[str]:
        """What its rows are: its source's own identity (sources/base.py), one entry."""
        return [self.source.content_identity()]

    def carried_tokenizer(self) -> str | None:
        return self.source.carried_tokenizer()

    def texts(self):
        """Every document's text (an 'auto' tokenizer trains on them); conversations refuse."""
        return self.packing.texts(self)

    def windows(self, ctx):
        """(mixture source, validation windows) of this rank: its part of a mixture."""
        return self.packing.windows(self, ctx)

    def batches(self, ctx):
        """(endless training batches, validation windows) when it is the only dataset."""
        return self.packing.batches(self, ctx)

    def whole_stream(self, tokenizer, max_tokens: int | None):
        """Its tokens read whole (a dedicated validation set): all of them (max_tokens None),
        or the first max_tokens."""
        return self.packing.whole_stream(self, tokenizer, max_tokens)


def parse_dataset(dcfg, key: str = "data.dataset") -> Dataset:
    """The Dataset of `dcfg.dataset`, its spec checked without reading data."""
    return Dataset.parse(dcfg, key)


def parse_data(dcfg):
    """The data config's dataset: data.dataset's Dataset, or a Mixture of data.sources."""
    return parse_dataset(dcfg) if not dcfg.sources else Mixture.parse(dcfg, parse_dataset)


def documents(dcfg):
    """Every document's text of data.dataset, in the dataset's order (sources that hold text)."""
    return parse_dataset(dcfg).texts()


def check_data(dcfg, vcfg) -> None:
    """Parse every dataset spec of the [data] and [validation] sections (the launcher's
    pre-flight check)."""
    parse_data(dcfg).preflight()
    if vcfg.dataset:
        other = copy.copy(dcfg)
        other.dataset, other.sources = vcfg.dataset, []
        try:
            parse_dataset(other, "validation.dataset").preflight()
        except ConfigError as e:
            raise as_key(e, "validation.dataset") from None


def as_key(error: ConfigError, key: str) -> ConfigError:
    """`error` of a data spec read for `key` (e.g. validation.dataset) instead of data.dataset,
    which the sources' messages name: the key the user wrote."""
    return ConfigError(str(error).replace("data.dataset", key),
                       key if error.key in (None, "data.dataset") else error.key)
