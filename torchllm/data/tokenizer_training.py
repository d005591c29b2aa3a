"""Training a byte-fallback BPE SentencePiece tokenizer on text: what data.tokenizer = 'auto'
trains on the data's first source (torchllm.data.build_tokenizer) and what the command
`python -m torchllm.tools.train_tokenizer` trains on files."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Iterable, Iterator

from torchllm.config.job_config import ConfigError


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
