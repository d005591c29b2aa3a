"""Tokenizers behind one small interface: encode / decode / vocab_size / bos_id / eos_id."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Iterable, Protocol

from torchllm.config.job_config import ConfigError


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

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        return [self.bos_id] * bos + self.sp.encode(text) + [self.eos_id] * eos

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(list(ids))


def train_sentencepiece(
    texts: Iterable[str], vocab_size: int, out: str | Path, num_threads: int = 2
) -> Path:
    """Train a byte-fallback BPE SentencePiece model on `texts` and write it to `out` atomically."""
    import sentencepiece as spm

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = (line for text in texts for line in text.splitlines() if line.strip())
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines,
        model_writer=proto,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        num_threads=num_threads,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_bytes(proto.getvalue())
    tmp.replace(out)
    return out
