"""Tokenizers behind one small interface: encode / decode / vocab_size / bos_id / eos_id.

Three on-disk formats are understood, so a run can use the tokenizer its model was trained with:
SentencePiece `.model` files (Llama 2 style), tiktoken BPE rank files (GPT-2's `r50k_base` and
Llama 3's `tokenizer.model`) and Hugging Face `tokenizer.json` files (or a Hub name when online).

    python -m torchllm.data.tokenizer train --input a.txt b.jsonl --vocab-size 8000 --out DIR
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import re
import sys
from pathlib import Path
from typing import Iterable, Iterator, Protocol

from torchllm.config.job_config import ConfigError
from torchllm.data.chat_template import template_of


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


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer: a tokenizer.json file, its folder, or a Hub name.

    BOS/EOS come from a tokenizer_config.json beside the file when present, else from the
    usual special-token names.
    """

    BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>")
    EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")

    def __init__(self, spec: str | Path):
        from tokenizers import Tokenizer as _Tok

        path = Path(spec)
        config = {}
        if path.is_dir():
            path = path / "tokenizer.json"
        if path.suffix == ".json":
            if not path.is_file():
                raise ConfigError(f"tokenizer file {path} does not exist")
            try:
                self.tok = _Tok.from_file(str(path))
            except Exception as e:  # the Rust side raises a generic Exception
                raise ConfigError(f"tokenizer file {path} is not a tokenizer.json: {e}") from None
            cfg_file = path.with_name("tokenizer_config.json")
            if cfg_file.is_file():
                config = json.loads(cfg_file.read_text())
        else:
            from torchllm.hub import offline_note, prepare_hub

            offline = prepare_hub()
            try:
                self.tok = _from_hub(str(spec), offline)
            except Exception as e:
                raise ConfigError(hub_failure_message(str(spec), e) + offline_note(offline),
                                  "data.tokenizer") from None
        self.path = path
        self.config = config  # tokenizer_config.json: special tokens, chat_template
        self.chat_template = template_of(config)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special(config.get("bos_token"), self.BOS_NAMES, "BOS")
        self.eos_id = self._special(config.get("eos_token"), self.EOS_NAMES, "EOS")
        self.special_ids = frozenset(
            [i for i, t in self.tok.get_added_tokens_decoder().items() if t.special]
            + [self.bos_id, self.eos_id]
        )

    def _special(self, configured, names, what: str) -> int:
        if isinstance(configured, dict):
            configured = configured.get("content")
        for name in ([configured] if configured else []) + list(names):
            tid = self.tok.token_to_id(name)
            if tid is not None:
                return tid
        raise ConfigError(f"tokenizer {self.path} has no {what} token (looked for {', '.join(names)})")

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


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
        from torchllm.data.byte_tokenizer import ByteTokenizer

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


def _from_hub(name: str, offline: bool):
    """tokenizer.json of a Hub repo: downloaded (or cached), or offline from the cache only,
    failing at once when it is not there (the Rust loader would retry the network first)."""
    from tokenizers import Tokenizer as _Tok

    if not offline:
        return _Tok.from_pretrained(name)
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, "tokenizer.json")
    if not isinstance(cached, str):
        raise FileNotFoundError(f"{name}/tokenizer.json is not in the local Hugging Face cache")
    return _Tok.from_file(cached)


def hub_failure_message(name: str, error: Exception) -> str:
    """Why a Hub tokenizer did not load, and the ways to a working one (one line)."""
    reason = " ".join(str(error).split())[:300]
    return (
        f"data.tokenizer = {name!r} is not a file and could not be loaded from the Hugging Face "
        f"Hub ({type(error).__name__}: {reason}). Online: check the name (gated models such as "
        f"meta-llama/* need `hf auth login` and an accepted license). Offline: on a "
        f"machine with network run `hf download {name} tokenizer.json "
        f"--local-dir DIR`, copy DIR here and set data.tokenizer = 'DIR/tokenizer.json'; or "
        "set 'auto' to train a SentencePiece model on data.dataset"
    )


CHUNK_CHARS = 4096  # the longest piece of text handed to the SentencePiece trainer at once


def training_chunks(text: str, limit: int = CHUNK_CHARS) -> Iterator[str]:
    """`text` cut into pieces of at most `limit` characters that together are exactly `text`.

    Whole lines are gathered up to the limit (their newlines kept, so newlines get pieces of
    their own); a longer line is cut after its last sentence end (". ", "! ", "? ") or else its
    last whitespace in the second half of the limit, or else at the limit. So any text works:
    CRLF or LF, blank lines or none, blank lines holding spaces, one huge paragraph.
    """
    gathered, size = [], 0
    for line in text.splitlines(keepends=True):
        while len(line) > limit:
            if gathered:
                yield "".join(gathered)
                gathered, size = [], 0
            cut = _cut(line, limit)
            yield line[:cut]
            line = line[cut:]
        if size + len(line) > limit:
            yield "".join(gathered)
            gathered, size = [], 0
        gathered.append(line)
        size += len(line)
    if gathered:
        yield "".join(gathered)


def _cut(line: str, limit: int) -> int:
    """Where to end the first piece of an over-long line (see training_chunks)."""
    head = line[:limit]
    for ends in ((". ", "! ", "? "), (" ", "\t")):
        at = max(head.rfind(e) for e in ends)
        if at >= limit // 2:
            return at + len(ends[0])
    return limit


def train_sentencepiece(
    texts: Iterable[str], vocab_size: int, out: str | Path, num_threads: int = 2,
    max_chars: int | None = None, progress: bool = False,
    vocab_key: str = "data.tokenizer_vocab_size", source: str = "data.dataset",
) -> Path:
    """Train a byte-fallback BPE SentencePiece model on `texts` and write it to `out` atomically.

    Each text reaches the trainer whole, in `training_chunks` (nothing is dropped).
    `max_chars` caps the training text (a few tens of MB is plenty for a BPE vocabulary).
    `vocab_key` and `source` name the setting and the input in error messages.
    """
    import sentencepiece as spm

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)

    seen = [0]  # characters handed to the trainer

    def chunks():
        for text in texts:
            for chunk in training_chunks(text):
                if chunk.strip():  # whitespace alone teaches nothing; every other chunk goes in
                    seen[0] += len(chunk)
                    yield chunk
                if max_chars is not None and seen[0] >= max_chars:
                    from torchllm.log import logger

                    logger.info("tokenizer training: read the first %s characters of %s (the "
                                "cap; the rest is tokenized, not trained on)", f"{seen[0]:,}",
                                source)
                    return

    proto = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=chunks(),
            model_writer=proto,
            vocab_size=vocab_size,
            model_type="bpe",
            byte_fallback=True,
            character_coverage=1.0,
            # Lossless: decode(encode(text)) == text, newlines and runs of spaces included.
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            # Bytes; no chunk is longer (the trainer silently skips longer sentences).
            max_sentence_length=4 * CHUNK_CHARS,
            num_threads=num_threads,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            minloglevel=0 if progress else 2,
        )
    except RuntimeError as e:
        vocab = "too high" in str(e) or "required_chars" in str(e)
        raise ConfigError(_training_failure(str(e), seen[0], vocab_size, vocab_key, source),
                          vocab_key if vocab else None) from None
    tmp = out.with_suffix(out.suffix + f".tmp{id(proto)}")
    tmp.write_bytes(proto.getvalue())
    tmp.replace(out)
    return out


def _training_failure(error: str, chars: int, vocab_size: int, vocab_key: str,
                      source: str) -> str:
    """Our one-line account of a SentencePiece training error (its own are C++ assertions)."""
    if chars == 0:
        return (f"cannot train a SentencePiece tokenizer: {source} has no text (empty, or "
                "whitespace only); give it a non-empty file or dataset")
    most = re.search(r"value <= (\d+)", error)
    if most:
        return (f"{source} has only {chars:,} characters of text, too little for a "
                f"{vocab_size}-piece tokenizer (at most {most.group(1)} pieces can be learnt "
                f"from it); set {vocab_key} <= {most.group(1)} or give more text")
    least = re.search(r"smaller than required_chars\. \d+ vs (\d+)", error)
    if least:  # every distinct character is a piece, as are the 256 bytes and unk/bos/eos
        return (f"{source} has more distinct characters than a {vocab_size}-piece tokenizer "
                f"holds (with the 259 byte and control pieces it needs {least.group(1)}); set "
                f"{vocab_key} >= {least.group(1)}")
    return f"training a SentencePiece tokenizer on {source} failed: {' '.join(error.split())}"


def main(argv: list[str] | None = None) -> int:
    from torchllm.config.sections import Data
    from torchllm.data.sources import documents

    parser = argparse.ArgumentParser(prog="python -m torchllm.data.tokenizer")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a SentencePiece BPE model on text files")
    train.add_argument("--input", nargs="+", required=True,
                       help=".txt/.jsonl/.parquet files, globs or folders")
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--out", required=True, help="folder to write tokenizer.model into")
    train.add_argument("--text-column", default="text", help="column of .jsonl/.parquet rows")
    train.add_argument("--max-chars", type=int, default=200_000_000,
                       help="stop reading text after this many characters")
    train.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    print(f"training a {args.vocab_size}-piece SentencePiece BPE tokenizer on "
          f"{' '.join(args.input)} (up to {args.max_chars:,} characters)", file=sys.stderr)
    try:
        texts = (t for spec in args.input
                 for t in documents(Data(dataset=f"local:{spec}", text_column=args.text_column)))
        out = train_sentencepiece(texts, args.vocab_size, Path(args.out) / "tokenizer.model",
                                  args.threads, args.max_chars, progress=False,
                                  vocab_key="--vocab-size", source=" ".join(args.input))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = SentencePieceTokenizer(out)
    print(f"wrote {out} ({tok.vocab_size} pieces)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
