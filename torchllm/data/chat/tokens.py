"""Chat tokens: what a tokenizer needs to render conversations, and the tokens added to one that
has none of its own.

A tokenizer renders conversations natively when it has a Jinja `chat_template` (a tokenizer.json
tokenizer's tokenizer_config.json) or Llama 3's header tokens; every other one (SentencePiece,
GPT-2, ...) becomes a `ChatTokenizer`: the base plus 6 special tokens <|ROLE_start|> /
<|ROLE_end|>, their ids after the base vocabulary (data.chat_tokens, or chat data).
"""

from __future__ import annotations

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
