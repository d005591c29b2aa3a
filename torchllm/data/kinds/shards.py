"""data.dataset = "shards:DIR": tokens written by `python -m torchllm.data.prepare`, memory-mapped
(or shards:s3://bucket/prefix, any fsspec URL: read by byte range); the index records the
tokenizer and the train / val splits."""

from __future__ import annotations

import numpy as np

from torchllm.config.job_config import ConfigError
from torchllm.data import shards
from torchllm.data.kinds.base import TokenKind
from torchllm.data.kinds.registry import register
from torchllm.data.token_stream import TokenStream
from torchllm.storage import as_location, join


@register
class Shards(TokenKind):
    prefix = "shards"
    usage, order = "shards:DIR' or 'shards:s3://BUCKET/PREFIX", 2

    def carried_tokenizer(self) -> str:
        return shards.read_index(self.location)["tokenizer"]

    def texts(self):
        raise ConfigError("data.dataset: shards: datasets are already tokenized; they have no "
                          "text to read (use their tokenizer, recorded in index.json)")

    def check_vocab(self, tokenizer) -> None:
        index = shards.read_index(self.location)
        if index["vocab_size"] != tokenizer.vocab_size:
            raise ConfigError(
                f"{join(as_location(self.location), shards.INDEX)}: shards were tokenized with a "
                f"{index['vocab_size']}-token vocab ({index['tokenizer']}), but data.tokenizer "
                f"has {tokenizer.vocab_size}; use the shards' tokenizer (data.tokenizer = "
                "'auto' does)", "data.tokenizer"
            )

    def token_split(self, tokenizer) -> tuple[TokenStream, TokenStream]:
        self.check_vocab(tokenizer)
        train, val = (shards.open_split(self.location, s) for s in ("train", "val"))
        return train, val

    def whole_stream(self, tokenizer, max_tokens: int) -> TokenStream:
        """The val split, then the train split."""
        self.check_vocab(tokenizer)
        val, train = (shards.open_split(self.location, s) for s in ("val", "train"))
        parts = [p for s in (val, train) if len(s) for p in s.parts]
        if not parts:
            raise ConfigError(f"{self.spec!r} holds no tokens", "data.dataset")
        starts = np.concatenate([val.doc_starts, train.doc_starts + len(val)])
        stream = TokenStream(parts, starts)
        return TokenStream(stream.parts, stream.doc_starts, 0, min(len(stream), max_tokens))
