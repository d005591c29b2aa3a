"""Conversations: chat templates with an assistant-only loss mask, and `chat:` window sources.

A conversation is a list of {"role": "system" | "user" | "assistant", "content": str} (the
common `messages` column of jsonl/parquet/Hugging Face datasets). It is rendered to token ids
with a template:

    jinja    a tokenizer.json tokenizer's own Jinja `chat_template` (its tokenizer_config.json,
             e.g. Llama 3 Instruct, Qwen3), rendered as transformers does (chat_template.py)
    llama3   the tokenizer's own (Llama 3 tiktoken or tokenizer.json with its header tokens):
             <|begin_of_text|> then per message
             <|start_header_id|>ROLE<|end_header_id|>\\n\\n CONTENT <|eot_id|>
    tokens   every other tokenizer (the fallback) (SentencePiece, GPT-2, ...): BOS then per message
             <|ROLE_start|> CONTENT <|ROLE_end|>, the 6 special tokens added to the vocabulary
             after the base tokenizer's ids (`ChatTokenizer`)

Only the assistant's content and its end-of-turn token are targets; every other token (BOS,
headers, system and user turns) is ignored in the loss (-100). Generation stops at the
end-of-turn token (<|eot_id|> or <|assistant_end|>).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from torchllm.config.job_config import ConfigError, document_masking
from torchllm.data.chat_template import JinjaChat
from torchllm.log import logger

IGNORE = -100  # the loss's ignore index (torchllm.loss.IGNORE_INDEX; no upward import)
ROLES = ("system", "user", "assistant")
ADDED_TOKENS = tuple(f"<|{role}_{edge}|>" for role in ROLES for edge in ("start", "end"))
LLAMA3_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def special_id(tokenizer, name: str) -> int | None:
    """The id of special token `name` in a tiktoken or tokenizer.json tokenizer, else None."""
    enc = getattr(tokenizer, "enc", None)
    if enc is not None:
        return enc.encode_single_token(name) if name in enc.special_tokens_set else None
    tok = getattr(tokenizer, "tok", None)  # HFTokenizer
    if tok is not None:
        return tok.token_to_id(name)
    return None


def has_native_template(tokenizer) -> bool:
    """A Jinja chat template of its own, or Llama 3's header tokens (no tokens to add)."""
    if getattr(tokenizer, "chat_template", None):
        return True
    return all(special_id(tokenizer, t) is not None for t in LLAMA3_TOKENS)


class ChatTokenizer:
    """A base tokenizer plus the 6 <|ROLE_start|> / <|ROLE_end|> tokens, ids after its own."""

    def __init__(self, base):
        self.base = base
        self.added = {name: base.vocab_size + i for i, name in enumerate(ADDED_TOKENS)}
        self.names = {i: name for name, i in self.added.items()}
        self.vocab_size = base.vocab_size + len(ADDED_TOKENS)
        self.bos_id, self.eos_id = base.bos_id, base.eos_id

    def __getattr__(self, name):  # path, sp, ...: the base tokenizer's
        return getattr(self.base, name)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        return self.base.encode(text, bos=bos, eos=eos)  # text never becomes an added token

    def decode(self, ids) -> str:
        out, run = [], []
        for i in ids:
            if int(i) in self.names:
                out += [self.base.decode(run), self.names[int(i)]]
                run = []
            else:
                run.append(int(i))
        return "".join(out + [self.base.decode(run)])


@dataclass(frozen=True)
class Rendered:
    ids: list[int]
    trained: list[bool]  # whether token i is a target (assistant content or its end of turn)


class ChatTemplate:
    """Render conversations (and generation prompts) for one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.native = False  # Llama 3's header tokens, rendered by hand below
        if getattr(tokenizer, "chat_template", None):  # the tokenizer's own (chat_template.py)
            self.kind = "jinja"
            self.jinja = JinjaChat(tokenizer, tokenizer.chat_template, special_names(tokenizer))
            self.end_of_turn = self.jinja.end_of_turn
        elif has_native_template(tokenizer):
            self.native = True
            self.kind = "llama3"
            self.start_header, self.end_header, self.eot = (special_id(tokenizer, t)
                                                            for t in LLAMA3_TOKENS)
            self.end_of_turn = self.eot
        elif isinstance(tokenizer, ChatTokenizer):
            self.kind = "tokens"
            self.end_of_turn = tokenizer.added["<|assistant_end|>"]
        else:
            raise ConfigError(
                "this tokenizer has no chat template and no chat tokens; conversations need "
                "data.chat_tokens = true (adds <|user_start|> ... to the vocab) or a tokenizer "
                "with Llama 3's header tokens", "data.chat_tokens")

    def header(self, role: str) -> list[int]:
        if self.native:
            return ([self.start_header] + self.tokenizer.encode(role) + [self.end_header]
                    + self.tokenizer.encode("\n\n"))
        return [self.tokenizer.added[f"<|{role}_start|>"]]

    def footer(self, role: str) -> list[int]:
        return [self.eot] if self.native else [self.tokenizer.added[f"<|{role}_end|>"]]

    def render(self, messages: list[dict]) -> Rendered:
        ids, trained = [self.tokenizer.bos_id], [False]
        for k, m in enumerate(messages):
            role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (0, 0)
            if role not in ROLES or not isinstance(content, str):
                raise ValueError(f"message {k} must be {{'role': one of {', '.join(ROLES)}, "
                                 f"'content': str}}, got {_short(m)}")
        if self.kind == "jinja":
            return Rendered(*self.jinja.render(messages))
        for m in messages:
            role, content = m["role"], m["content"]
            head, foot = self.header(role), self.footer(role)
            content_from = 0
            if self.native:  # the header's "\n\n" and the content are one text run, tokenized
                # whole as transformers does: "\n\n" + "\nHi" is "\n\n\n", "Hi"
                head = head[: -len(self.tokenizer.encode("\n\n"))]
                body = self.tokenizer.encode("\n\n" + content)
                content_from = _text_start(self.tokenizer, body, 2)
            else:
                body = self.tokenizer.encode(content)
            ids += head + body + foot
            trained += [False] * (len(head) + content_from) + [role == "assistant"] * (
                len(body) - content_from + len(foot))
        return Rendered(ids, trained)

    def prompt(self, messages: list[dict]) -> list[int]:
        """Ids of a conversation so far plus the assistant's header: generate from here."""
        if self.kind == "jinja":
            return self.jinja.prompt(messages)
        return self.render(messages).ids + self.header("assistant")


def _text_start(tokenizer, ids: list[int], prefix_bytes: int) -> int:
    """How many leading `ids` hold only the first `prefix_bytes` bytes of their text: the first
    token holding any later character (a merged "\n\n\n" too) is the content's (a target, as
    in transformers' assistant mask)."""
    k = 0
    while k < len(ids) and len(tokenizer.decode(ids[: k + 1]).encode()) <= prefix_bytes:
        k += 1
    return k


def special_names(tokenizer) -> dict[str, str]:
    """bos_token, eos_token, ... by name, as a Jinja chat template reads them."""
    names = {"bos_token": tokenizer.tok.id_to_token(tokenizer.bos_id),
             "eos_token": tokenizer.tok.id_to_token(tokenizer.eos_id)}
    for key, value in getattr(tokenizer, "config", {}).items():
        if key.endswith("_token") and isinstance(value, dict):
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            names.setdefault(key, value)
    return names


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


def masked_batch(tokens: torch.Tensor, trained: torch.Tensor, positions: torch.Tensor):
    """The batch of whole windows [k, seq_len + 1]: targets are the next tokens where they
    are trained (assistant tokens), IGNORE elsewhere."""
    targets = tokens[:, 1:].clone()
    targets[~trained[:, 1:]] = IGNORE  # only assistant tokens
    return {"inputs": tokens[:, :-1], "targets": targets, "positions": positions[:, :-1]}


class ChatSource:
    """Conversations packed into windows once, read in a seeded order per epoch (a mixture
    source; also the whole dataset for data.dataset = "chat:...")."""

    def __init__(self, tokens, mask, positions, seed: int):
        self.tokens, self.mask, self.positions = tokens, mask, positions
        self.windows_per_epoch, self.seed = len(tokens), seed

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.windows_per_epoch)

    def read(self, ids) -> dict[str, torch.Tensor]:
        ids = np.asarray(ids, dtype=np.int64)
        return masked_batch(*(torch.from_numpy(a[ids])
                              for a in (self.tokens, self.mask, self.positions)))


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


def read_conversations(location: str, dcfg) -> list:
    """`messages` values of chat:PATH's rows (jsonl/parquet file, glob or folder), read whole."""
    from torchllm.data.kinds.chat import rows_source

    ds, column = rows_source(location, dcfg).open_rows(dcfg.chat_column)
    return [row[column] for row in ds]  # a local file that cannot be read is named (sources.py)


def render_row(template: ChatTemplate, messages, where: str, column: str) -> Rendered:
    """A row's conversation rendered; ConfigError naming `where` (the source, the row) when it
    is not a list of {'role', 'content'} messages."""
    if not isinstance(messages, (list, tuple)):
        raise ConfigError(f"{where}: {column!r} must be a list of {{'role', 'content'}} "
                          f"messages, got {type(messages).__name__} {_short(messages)}",
                          "data.dataset")
    try:
        return template.render(list(messages))
    except ValueError as e:
        raise ConfigError(f"{where}: {e}", "data.dataset") from None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_independent(job_config, where: str) -> None:
    """Packed conversations must not see each other: ConfigError unless each attends only
    within itself with its positions from 0 (model.attn_mask_type = block_causal,
    restart_positions_per_document; their unset values for chat data), or one per window."""
    if job_config.data.chat_packing != "pack":
        return  # one conversation per window: plain causal attention sees only its own tokens
    mask, restart = document_masking(job_config)
    if mask != "block_causal" or not restart:
        key = ("model.attn_mask_type" if mask != "block_causal"
               else "model.restart_positions_per_document")
        raise ConfigError(
            f"{where}: data.chat_packing = 'pack' with model.attn_mask_type = {mask!r} and "
            f"model.restart_positions_per_document = {str(restart).lower()} trains each "
            "conversation of a window as a continuation of the ones packed before it; leave both "
            "unset (chat data: block_causal with restarted positions) or set them so, or use "
            "data.chat_packing = 'pad' (one conversation per window)", key)


def build_chat_source(location: str, job_config, tokenizer, dp_rank: int, dp_degree: int,
                      seed: int):
    """(ChatSource of the training windows, ChatVal) for chat:LOCATION (local files, whole)."""
    dcfg, window = job_config.data, job_config.training.seq_len + 1
    template = ChatTemplate(tokenizer)
    convs = read_conversations(location, dcfg)
    rendered = [render_row(template, c, f"chat:{location}: row {i}", dcfg.chat_column)
                for i, c in enumerate(convs)]
    tokens, mask, positions, truncated = window_rows(rendered, window, dcfg.chat_packing,
                                                     tokenizer.eos_id)
    if dp_rank == 0:
        logger.info("chat:%s: %d conversations (%s template) in %d windows of %d tokens (%s); "
                    "%d truncated to one window", location, len(convs), template.kind,
                    len(tokens), window, dcfg.chat_packing, truncated)
    n_val = int(len(tokens) * dcfg.val_fraction)
    source = ChatSource(tokens, mask, positions, seed)
    source.windows_per_epoch = len(tokens) - n_val  # the last n_val windows are held out
    if source.windows_per_epoch < 1:
        raise ConfigError(f"chat:{location} has no training windows ({len(tokens)} in all)",
                          "data.dataset")
    if not mask[: source.windows_per_epoch, 1:].any():  # the loss would be 0/0 at every step
        replies = sum(any(r.trained) for r in rendered)
        raise ConfigError(
            f"chat:{location}: no training window has a target token (only assistant turns are "
            f"trained; {replies} of {len(convs)} conversations have one"
            f"{', all cut off or held out for validation' if replies else ''}); check the "
            "messages' 'role' values", "data.dataset")
    return source, ChatVal(source, len(tokens) - n_val, n_val)
