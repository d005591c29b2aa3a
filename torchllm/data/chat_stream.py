"""Conversations streamed from a Hugging Face dataset (chat:hf:NAME), never read whole.

The rows stream through the same reader as Hub text (torchllm.data.hf_stream.StreamWindows:
split by rank and loader worker, state = the stream's `state_dict()` plus the unbatched
buffers, exact resume, a mixture source like any other). Only the packing differs:
`ChatPacking` renders each conversation with the tokenizer's chat template as it arrives and
lays it into whole windows as `chat.window_rows` does for files (a conversation that fits a
window is never split; padding and non-assistant tokens are not trained). The first
data.val_documents conversations are the validation split, held out by content as for text.
"""

from __future__ import annotations

import torch

from torchllm.config.job_config import ConfigError
from torchllm.data.chat import (ChatSource, ChatTemplate, ChatVal, Rendered, append_conversation,
                                masked_batch, render_row, window_rows)
from torchllm.log import logger

PROBE = 32  # conversations read at start to check that some assistant turn is trained


class ChatPacking:
    """How a stream's conversations become windows (TextPacking's counterpart for chat)."""

    buffers = ("tokens", "positions", "trained")

    def __init__(self, tokenizer, packing: str, where: str, column: str):
        self.tokenizer, self.packing, self.where, self.column = tokenizer, packing, where, column
        self.template = ChatTemplate(tokenizer)  # no template: the ConfigError at start
        self.cut = 0  # conversations cut to one window by this process

    def __getstate__(self):  # a Jinja template does not pickle: rebuilt in a loader worker
        return {**self.__dict__, "template": None}

    def render(self, messages) -> Rendered:
        if self.template is None:
            self.template = ChatTemplate(self.tokenizer)
        return render_row(self.template, messages, self.where, self.column)

    def add(self, messages, buf: dict[str, list], window: int) -> None:
        if append_conversation(buf, self.render(messages), window, self.packing,
                               self.tokenizer.eos_id):
            self.cut += 1
            if self.cut == 1:
                logger.info("%s: a conversation longer than a window (%d tokens) was cut to one "
                            "window (later ones are not logged)", self.where, window)

    def batch(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return masked_batch(rows["tokens"], rows["trained"], rows["positions"])

    def validation(self, held: list, ctx) -> ChatVal:
        """The held-out conversations' windows, packed as the training ones."""
        tokens, mask, positions, _ = window_rows([self.render(m) for m in held],
                                                 ctx.seq_len + 1, self.packing,
                                                 self.tokenizer.eos_id)
        return ChatVal(ChatSource(tokens, mask, positions, ctx.seed), 0, len(tokens))


def stream_chat_windows(rows, location: str, ctx):
    """(StreamWindows of chat:LOCATION's conversations, validation windows); `rows` is the
    streaming kind that reads LOCATION's rows (hf:NAME)."""
    dcfg = ctx.job_config.data
    pack = ChatPacking(ctx.tokenizer, dcfg.chat_packing, f"chat:{location}", dcfg.chat_column)
    first = [pack.render(m) for m in rows.first_values(dcfg.chat_column,
                                                       max(PROBE, dcfg.val_documents))]
    if not any(any(r.trained) for r in first):  # the loss would be 0/0 at every step
        raise ConfigError(
            f"chat:{location}: none of the first {len(first)} conversations has an assistant "
            "turn (only assistant turns are trained); check the messages' 'role' values",
            "data.dataset")
    reader, val = rows.stream_windows(ctx, dcfg.chat_column, pack)
    if ctx.dp_rank == 0:
        logger.info("chat:%s: streamed, %s template, whole conversations %s into windows of %d "
                    "tokens as they are read; the first %d held out for validation (%d windows)",
                    location, pack.template.kind, "packed" if pack.packing == "pack" else
                    "one per window", ctx.seq_len + 1, dcfg.val_documents, val.count)
    return reader, val
