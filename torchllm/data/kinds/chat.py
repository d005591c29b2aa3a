"""data.dataset = "chat:PATH" (.jsonl/.parquet conversations: a file, glob or folder) or
"chat:hf:NAME" (a Hugging Face dataset): conversations rendered with a chat template, loss on the
assistant's replies only (torchllm/data/chat.py). Rows are read through the local or hf kind:
local files whole (windows in a seeded order per epoch), a Hugging Face dataset streamed as it
arrives, like Hub text (torchllm/data/chat_stream.py)."""

from __future__ import annotations

import copy

from torchllm.config.job_config import ConfigError
from torchllm.data.chat import build_chat_source, check_independent
from torchllm.data.chat_stream import stream_chat_windows
from torchllm.data.kinds.base import Context, DataKind
from torchllm.data.kinds.registry import parse_source, register


def rows_source(location: str, dcfg):
    """The kind that reads chat:LOCATION's rows: hf:NAME streamed, else local files."""
    inner = copy.copy(dcfg)
    inner.dataset = location if location.startswith("hf:") else f"local:{location}"
    inner.sources = []
    kind = parse_source(inner)
    kind.label = "chat"  # a local file that cannot be read is named as chat:PATH's
    return kind


@register
class Chat(DataKind):
    prefix = "chat"
    usage, order = "chat:PATH' or 'chat:hf:NAME", 4
    chat = True
    wraps = True

    @classmethod
    def parse(cls, dcfg, location: str) -> "Chat":
        kind = super().parse(dcfg, location)
        rows_source(location, dcfg)  # the inner spec is checked now too
        return kind

    def preflight(self) -> None:
        rows_source(self.location, self.dcfg).preflight()  # chat:PATH's local files exist

    def texts(self):
        raise ConfigError("data.tokenizer = 'auto' cannot be trained on conversations; name the "
                          "tokenizer (e.g. the base model's)", "data.tokenizer")

    def windows(self, ctx: Context):
        check_independent(ctx.job_config, self.spec)
        rows = rows_source(self.location, self.dcfg)
        if rows.streams:
            return stream_chat_windows(rows, self.location, ctx)
        return build_chat_source(self.location, ctx.job_config, ctx.tokenizer, ctx.dp_rank,
                                 ctx.dp_degree, ctx.seed)

    def whole_stream(self, tokenizer, max_tokens: int):
        raise ConfigError(f"{self.spec!r}: conversations cannot be a validation.dataset; their "
                          "validation split is the last data.val_fraction of their windows",
                          "validation.dataset")
