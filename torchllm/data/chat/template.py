"""Rendering conversations to token ids with a chat template, and which of them are trained.

A conversation is a list of {"role": "system" | "user" | "assistant", "content": str} (the
common `messages` column of jsonl/parquet/Hugging Face datasets). It is rendered with a template:

    jinja    a tokenizer.json tokenizer's own Jinja `chat_template` (its tokenizer_config.json,
             e.g. Llama 3 Instruct, Qwen3), rendered as transformers does (chat/jinja.py)
    llama3   the tokenizer's own (Llama 3 tiktoken or tokenizer.json with its header tokens):
             <|begin_of_text|> then per message
             <|start_header_id|>ROLE<|end_header_id|>\\n\\n CONTENT <|eot_id|>
    tokens   every other tokenizer (the fallback) (SentencePiece, GPT-2, ...): BOS then per message
             <|ROLE_start|> CONTENT <|ROLE_end|>, the 6 special tokens added to the vocabulary
             after the base tokenizer's ids (chat/tokens.py's `ChatTokenizer`)

Only the assistant's content and its end-of-turn token are targets; every other token (BOS,
headers, system and user turns) is not trained. Generation stops at the end-of-turn token
(<|eot_id|> or <|assistant_end|>). Laying rendered conversations into windows is the chat
packing's (torchllm/data/packing/chat.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchllm.config.job_config import ConfigError
from torchllm.data.chat.jinja import JinjaChat
from torchllm.data.chat.tokens import (LLAMA3_TOKENS, ROLES, ChatTokenizer, has_native_template,
                                       special_id)


@dataclass(frozen=True)
class Rendered:
    ids: list[int]
    trained: list[bool]  # whether token i is a target (assistant content or its end of turn)


class ChatTemplate:
    """Render conversations (and generation prompts) for one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.native = False  # Llama 3's header tokens, rendered by hand below
        if getattr(tokenizer, "chat_template", None):  # the tokenizer's own (chat/jinja.py)
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
