"""The chat packing: conversations rendered with a chat template (torchllm/data/chat/) and laid into
windows whole, with an assistant-only loss mask (data.dataset = "chat:PATH" or "chat:hf:NAME").

A conversation that fits a window is never split: packing "pack" puts it in the current window if
it fits, else pads that window's rest and starts the next; "pad" puts one per window. Padding and
every token but the assistant's content and its end of turn are not trained (targets IGNORE).
Packed conversations are independent documents: block_causal attention and positions restarted
per conversation (config.job_config.document_masking, checked by `check_independent`).

The rows come from the source either way it gives them (torchllm/data/sources/base.py):
    at hand (local files)  rendered and packed once, read in a seeded order per epoch
                           (`ChatSource`); the last data.val_fraction of the windows is held out
    streamed (hf:NAME)     `ChatPacking` renders each conversation as it arrives, through the same
                           reader, state and exact resume as Hub text; the first
                           data.val_documents conversations are held out, by content
Alone, a chat dataset's batches are a mixture of one source (torchllm.data.mixture).
"""

from __future__ import annotations

import numpy as np
import torch

from torchllm.config.job_config import ConfigError, document_masking
from torchllm.data.chat.template import ChatTemplate, Rendered, render_row
from torchllm.data.mixture import MixtureBatches
from torchllm.data.sources.base import Context
from torchllm.data.token_stream import count
from torchllm.log import logger

IGNORE = -100  # the loss's ignore index (torchllm.loss.IGNORE_INDEX; no upward import)
PROBE = 32  # conversations read at start to check that some assistant turn is trained


class ChatPacking:
    """The chat packing (module doc). The class is the choice a Dataset makes (`windows`,
    `batches`, ...: class methods); an instance packs one stream's conversations as they
    arrive (`add`, `batch`, `validation`: packing/text.py's TextPacking's counterparts)."""

    chat = True  # conversations: the tokenizer needs a chat template (or the chat tokens)
    usage = "chat:PATH' or 'chat:hf:NAME"  # how to write it, for the "is not known" error
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

    def validation(self, held: list, ctx: Context) -> ChatVal:
        """The held-out conversations' windows, packed as the training ones."""
        tokens, mask, positions, _ = window_rows([self.render(m) for m in held],
                                                 ctx.seq_len + 1, self.packing,
                                                 self.tokenizer.eos_id)
        return ChatVal(ChatSource(tokens, mask, positions, ctx.seed), 0, len(tokens))

    # -- the choice: a Dataset's windows and batches with this packing ------------------------
    @classmethod
    def texts(cls, ds):
        raise ConfigError("data.tokenizer = 'auto' cannot be trained on conversations; name the "
                          "tokenizer (e.g. the base model's)", "data.tokenizer")

    @classmethod
    def windows(cls, ds, ctx: Context):
        """(mixture source, validation windows) of ds's conversations for this rank."""
        check_independent(ctx.data, ctx.batching.model, ds.spec)
        if ds.source.streams:
            return stream_chat_windows(ds, ctx)
        return build_chat_source(ds, ctx)

    @classmethod
    def batches(cls, ds, ctx: Context):
        """Alone: a mixture of one source (ctx.seed is then the run's; the source's derives)."""
        return MixtureBatches.alone(lambda one: cls.windows(ds, one), ds.spec, ctx)

    @classmethod
    def whole_stream(cls, ds, tokenizer, max_tokens: int):
        raise ConfigError(f"{ds.spec!r}: conversations cannot be a validation.dataset; their "
                          "validation split is the last data.val_fraction of their windows",
                          "validation.dataset")


def append_conversation(buf: dict[str, list], conv: Rendered, window: int, packing: str,
                        pad_id: int) -> bool:
    """Lay one rendered conversation into flat buffers of whole windows of `window` tokens
    (`tokens`, `trained`, `positions`; their length starts at a window boundary).

    packing "pack": a conversation goes into the current window if it fits, else the rest of
    that window is padding (pad_id, not trained, position 0) and it starts the next one, so a
    conversation that fits a window is never split; "pad": one conversation per window. A
    conversation longer than a window is cut to one window. Returns whether it was cut.
    """
    ids, trained, cut = conv.ids, conv.trained, len(conv.ids) > window
    if cut:
        ids, trained = ids[:window], trained[:window]
    used = len(buf["tokens"]) % window
    if used and (packing == "pad" or used + len(ids) > window):
        pad = window - used
        buf["tokens"] += [pad_id] * pad
        buf["trained"] += [False] * pad
        buf["positions"] += [0] * pad
    buf["tokens"] += ids
    buf["trained"] += trained
    buf["positions"] += range(len(ids))
    return cut


def window_rows(convs: list[Rendered], window: int, packing: str, pad_id: int):
    """Pack rendered conversations into windows of `window` tokens (seq_len + 1), in order, as
    `append_conversation` lays them (the last window padded to its end). Returns (tokens,
    trained, positions) arrays [n, window] and the number of truncated conversations."""
    buf: dict[str, list] = {"tokens": [], "trained": [], "positions": []}
    truncated = sum(append_conversation(buf, c, window, packing, pad_id) for c in convs)
    rows = -(-len(buf["tokens"]) // window)
    tail = rows * window - len(buf["tokens"])
    buf["tokens"] += [pad_id] * tail
    buf["trained"] += [False] * tail
    buf["positions"] += [0] * tail
    shaped = {k: np.array(v, dtype=bool if k == "trained" else np.int64).reshape(rows, window)
              for k, v in buf.items()}
    return shaped["tokens"], shaped["trained"], shaped["positions"], truncated


def unpadded_tokens(positions: torch.Tensor) -> torch.Tensor:
    """How many input tokens of a packed chat batch are conversation, not padding (a 0-dim
    tensor). Padding sits at position 0 like a conversation's first token, but only a
    conversation's first token is followed by position 1 (every rendered conversation has at
    least two tokens, and `append_conversation` never starts one in a window's last place)."""
    starts = (positions[..., :-1] == 0) & (positions[..., 1:] == 1)
    return (positions > 0).sum() + starts.sum()


def processed_tokens(batch: dict, packed_chat: bool) -> int:
    """Input tokens the model processes in a micro-batch: all of them, but a packed chat
    batch's padding (throughput, MFU and tokens seen count these; the loss's trained tokens,
    e.g. assistant tokens only, are a figure of their own)."""
    if packed_chat and "positions" in batch:
        return int(unpadded_tokens(batch["positions"]))
    return batch["inputs"].numel()


def masked_batch(tokens: torch.Tensor, trained: torch.Tensor, positions: torch.Tensor):
    """The batch of whole windows [k, seq_len + 1]: targets are the next tokens where they
    are trained (assistant tokens), IGNORE elsewhere."""
    targets = tokens[:, 1:].clone()
    targets[~trained[:, 1:]] = IGNORE  # only assistant tokens
    return {"inputs": tokens[:, :-1], "targets": targets, "positions": positions[:, :-1]}


class ChatSource:
    """Conversations packed into windows once, read in a seeded order per epoch (a mixture
    source; alone, a mixture of one)."""

    def __init__(self, tokens, mask, positions, seed: int):
        self.tokens, self.mask, self.positions = tokens, mask, positions
        self.windows_per_epoch, self.seed = len(tokens), seed

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.windows_per_epoch)

    def read(self, ids) -> dict[str, torch.Tensor]:
        ids = np.asarray(ids, dtype=np.int64)
        return masked_batch(*(torch.from_numpy(a[ids])
                              for a in (self.tokens, self.mask, self.positions)))

    def describe(self) -> str:
        """Its size as a mixture source (the run header)."""
        return f"{count(self.windows_per_epoch, 'window')} per epoch"


class ChatVal(torch.utils.data.Dataset):
    """The held-out windows of a ChatSource, all of them (the same on every rank: evaluation
    shares them out, see torchllm.data.windows.ValWindows)."""

    def __init__(self, source: ChatSource, first: int, count: int):
        self.source, self.first, self.count = source, first, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.count:
            raise IndexError(i)
        return {k: v[0] for k, v in self.source.read([self.first + i]).items()}

    def describe(self) -> str:
        return f"validation {count(self.count, 'window')}"


def check_independent(dcfg, mcfg, where: str) -> None:
    """Packed conversations must not see each other: ConfigError unless each attends only
    within itself with its positions from 0 (model.attn_mask_type = block_causal,
    restart_positions_per_document; their unset values for chat data), or one per window.
    `dcfg`, `mcfg`: the [data] and [model] sections."""
    if dcfg.chat_packing != "pack":
        return  # one conversation per window: plain causal attention sees only its own tokens
    mask, restart = document_masking(mcfg, dcfg)
    if mask != "block_causal" or not restart:
        key = ("model.attn_mask_type" if mask != "block_causal"
               else "model.restart_positions_per_document")
        raise ConfigError(
            f"{where}: data.chat_packing = 'pack' with model.attn_mask_type = {mask!r} and "
            f"model.restart_positions_per_document = {str(restart).lower()} trains each "
            "conversation of a window as a continuation of the ones packed before it; leave both "
            "unset (chat data: block_causal with restarted positions) or set them so, or use "
            "data.chat_packing = 'pad' (one conversation per window)", key)


def build_chat_source(ds, ctx: Context):
    """(ChatSource of the training windows, ChatVal) of ds's conversations read whole (local
    files)."""
    dcfg, window, spec, tokenizer = ctx.data, ctx.seq_len + 1, ds.spec, ctx.tokenizer
    template = ChatTemplate(tokenizer)
    convs = ds.source.values(dcfg.chat_column, spec)
    rendered = [render_row(template, c, f"{spec}: row {i}", dcfg.chat_column)
                for i, c in enumerate(convs)]
    tokens, mask, positions, truncated = window_rows(rendered, window, dcfg.chat_packing,
                                                     tokenizer.eos_id)
    if ctx.dp_rank == 0:
        logger.info("%s: %d conversations (%s template) in %d windows of %d tokens (%s); "
                    "%d truncated to one window", spec, len(convs), template.kind,
                    len(tokens), window, dcfg.chat_packing, truncated)
    n_val = int(len(tokens) * dcfg.val_fraction)
    source = ChatSource(tokens, mask, positions, ctx.seed)
    source.windows_per_epoch = len(tokens) - n_val  # the last n_val windows are held out
    if source.windows_per_epoch < 1:
        raise ConfigError(f"{spec} has no training windows ({len(tokens)} in all)",
                          "data.dataset")
    if not mask[: source.windows_per_epoch, 1:].any():  # the loss would be 0/0 at every step
        replies = sum(any(r.trained) for r in rendered)
        raise ConfigError(
            f"{spec}: no training window has a target token (only assistant turns are "
            f"trained; {replies} of {len(convs)} conversations have one"
            f"{', all cut off or held out for validation' if replies else ''}); check the "
            "messages' 'role' values", "data.dataset")
    return source, ChatVal(source, len(tokens) - n_val, n_val)


def stream_chat_windows(ds, ctx: Context):
    """(the stream's reader of ds's conversations, validation windows); ds.source streams its
    rows (hf:NAME)."""
    dcfg, rows, spec = ctx.data, ds.source, ds.spec
    pack = ChatPacking(ctx.tokenizer, dcfg.chat_packing, spec, dcfg.chat_column)
    first = [pack.render(m) for m in rows.first_values(dcfg.chat_column,
                                                       max(PROBE, dcfg.val_documents))]
    if not any(any(r.trained) for r in first):  # the loss would be 0/0 at every step
        raise ConfigError(
            f"{spec}: none of the first {len(first)} conversations has an assistant "
            "turn (only assistant turns are trained); check the messages' 'role' values",
            "data.dataset")
    reader, val = rows.stream_windows(ctx, dcfg.chat_column, pack)
    if ctx.dp_rank == 0:
        logger.info("%s: streamed, %s template, whole conversations %s into windows of %d "
                    "tokens as they are read; the first %d held out for validation (%d windows)",
                    spec, pack.template.kind, "packed" if pack.packing == "pack" else
                    "one per window", ctx.seq_len + 1, dcfg.val_documents, val.count)
    return reader, val
