"""Tokenizers behind one small interface: encode / decode / vocab_size / bos_id / eos_id.

Three on-disk formats are understood, so a run can use the tokenizer its model was trained with:
SentencePiece `.model` files (Llama 2 style), tiktoken BPE rank files (GPT-2's `r50k_base` and
Llama 3's `tokenizer.model`) and Hugging Face `tokenizer.json` files (or a Hub name when online;
torchllm/data/tokenizer_json.py), plus "bytes" (torchllm/data/byte_tokenizer.py).
`load_tokenizer` is the one place that tells them apart. Training a SentencePiece model:
torchllm/data/tokenizer_training.py (and its command, `python -m torchllm.tools.train_tokenizer`).
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Protocol

from torchllm.config.job_config import ConfigError
from torchllm.data.byte_tokenizer import ByteTokenizer
from torchllm.data.tokenizer_json import HFTokenizer


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class SentencePieceTokenizer:
    """A SentencePiece `.model` file (Llama-2 style: unk/bos/eos = 0/1/2, byte fallback)."""

    def __init__(self, path: str | Path):
        import sentencepiece as spm

        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"tokenizer file {path} does not exist")
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as e:
            raise ConfigError(f"tokenizer file {path} is not a SentencePiece model: {e}") from None
        self.path = path
        self.vocab_size = self.sp.vocab_size()
        self.bos_id = self.sp.bos_id()
        self.eos_id = self.sp.eos_id()
        self.special_ids = frozenset(i for i in range(self.vocab_size) if self.sp.is_control(i))

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        return [self.bos_id] * bos + self.sp.encode(text) + [self.eos_id] * eos

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(list(ids))


# Pre-tokenization regexes, as published with each tokenizer.
GPT2_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_RANKS = 128_000
GPT2_RANKS = 50_256


def llama3_special_tokens() -> list[str]:
    """Llama 3's 256 special tokens, in id order from 128000."""
    named = [
        "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
        "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
        "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
    ]
    return named + [f"<|reserved_special_token_{i}|>" for i in range(3, 256 - len(named) + 3)]


class TiktokenTokenizer:
    """A tiktoken BPE rank file: GPT-2 (50,256 ranks) or Llama 3 (128,000 ranks).

    The number of ranks tells which one it is, and so which regex and special tokens apply.
    GPT-2 has a single `<|endoftext|>` that serves as both BOS and EOS.
    """

    def __init__(self, path: str | Path):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        path = Path(path)
        try:
            ranks = load_tiktoken_bpe(str(path))
        except Exception as e:  # tiktoken raises bare ValueErrors/binascii errors on bad lines
            raise ConfigError(f"tokenizer file {path} is not a tiktoken BPE rank file: {e}") from None
        if len(ranks) == LLAMA3_RANKS:
            pattern, names = LLAMA3_PATTERN, llama3_special_tokens()
            bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
        elif len(ranks) == GPT2_RANKS:
            pattern, names, bos, eos = GPT2_PATTERN, ["<|endoftext|>"], "<|endoftext|>", "<|endoftext|>"
        else:
            raise ConfigError(
                f"tokenizer file {path} has {len(ranks)} BPE ranks; known tiktoken tokenizers "
                f"have {LLAMA3_RANKS} (Llama 3) or {GPT2_RANKS} (GPT-2)"
            )
        specials = {name: len(ranks) + i for i, name in enumerate(names)}
        self.enc = tiktoken.Encoding(
            name=path.stem, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
        )
        self.path = path
        self.vocab_size = self.enc.n_vocab
        self.bos_id, self.eos_id = specials[bos], specials[eos]
        self.special_ids = frozenset(specials.values())

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        # Special-token text inside documents is encoded as ordinary text, never as a control id.
        ids = self.enc.encode_ordinary(text)
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(list(ids))


def readable(tokenizer: Tokenizer, ids: list[int]) -> str:
    """Generated ids as text a person reads: cut at the first EOS, special tokens left out."""
    ids = list(ids)
    if tokenizer.eos_id in ids:
        ids = ids[: ids.index(tokenizer.eos_id)]
    special = getattr(tokenizer, "special_ids", {tokenizer.bos_id, tokenizer.eos_id})
    return tokenizer.decode([i for i in ids if i not in special])


def _looks_like_tiktoken(path: Path) -> bool:
    """tiktoken files are text lines 'base64token rank'; SentencePiece files are protobuf."""
    with open(path, "rb") as f:
        first = f.readline(200).split()
    if len(first) != 2 or not first[1].isdigit():
        return False
    try:
        base64.b64decode(first[0], validate=True)
    except ValueError:
        return False
    return True


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """A tokenizer from a file path (format detected from its content), "bytes" or a Hub name."""
    if str(spec) == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir() or path.suffix == ".json":
        return HFTokenizer(path)
    if path.is_file():
        if _looks_like_tiktoken(path):
            return TiktokenTokenizer(path)
        return SentencePieceTokenizer(path)
    if path.suffix in (".model", ".tiktoken") or str(spec).startswith((".", "/")):
        raise ConfigError(
            f"data.tokenizer: file {path} does not exist; {HOW_TO_GET_A_TOKENIZER}",
            "data.tokenizer",
        )
    return HFTokenizer(str(spec))


HOW_TO_GET_A_TOKENIZER = (
    "use a Hugging Face Hub name (online, e.g. 'gpt2' or 'meta-llama/Llama-3.2-1B' after "
    "`hf auth login`), download the file first (e.g. `hf download "
    "meta-llama/Llama-3.2-1B original/tokenizer.model --local-dir assets/llama3`), or set "
    "'auto' to train a SentencePiece model on data.dataset"
)


def tokenizer_sha256(tokenizer) -> str | None:
    """The SHA-256 of the file a tokenizer was read from (its base tokenizer's, before any added
    chat tokens), or None for one without a file ("bytes", a Hub name): what a checkpoint marker
    (tokenizer_record) and a shard index (prepare) record, and what shards are checked against."""
    base = getattr(tokenizer, "base", tokenizer)
    path = getattr(base, "path", None)
    if path is None or not Path(path).is_file():
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_name(tokenizer) -> str:
    """How a tokenizer is named in records and messages: its spec, its file, or its kind."""
    base = getattr(tokenizer, "base", tokenizer)
    path = getattr(base, "path", None)
    return getattr(base, "spec", None) or (str(path) if path is not None else type(base).__name__)
