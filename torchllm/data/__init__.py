"""Tokenizers and data loaders, built from the [data] config section."""

from __future__ import annotations

from pathlib import Path

import torch

from torchllm.config.job_config import ConfigError
from torchllm.data.embedded import embedded_documents
from torchllm.data.loader import PackedWindows, train_batches
from torchllm.data.tokenizer import SentencePieceTokenizer, Tokenizer, train_sentencepiece


def _documents(dataset: str) -> list[str]:
    if dataset == "embedded":
        return embedded_documents()
    raise ConfigError(f"data.dataset = {dataset!r} is not known; available: 'embedded'")


def build_tokenizer(job_config, data_dir: Path) -> Tokenizer:
    """Load data.tokenizer, or for 'auto' train a SentencePiece model once and cache it."""
    dcfg = job_config.data
    if dcfg.tokenizer != "auto":
        return SentencePieceTokenizer(dcfg.tokenizer)
    path = Path(data_dir) / f"tokenizer_{dcfg.dataset}_sp{dcfg.tokenizer_vocab_size}.model"
    if not path.is_file():
        train_sentencepiece(_documents(dcfg.dataset), dcfg.tokenizer_vocab_size, path)
    return SentencePieceTokenizer(path)


def build_data(job_config, tokenizer: Tokenizer, dp_rank: int, dp_degree: int):
    """(endless train batch iterator, validation windows) for this data-parallel rank."""
    dcfg, tcfg = job_config.data, job_config.training
    ids = [t for doc in _documents(dcfg.dataset) for t in tokenizer.encode(doc, bos=True, eos=True)]
    tokens = torch.tensor(ids, dtype=torch.long)
    n_val = int(len(tokens) * dcfg.val_fraction)
    train = PackedWindows(tokens[: len(tokens) - n_val], tcfg.seq_len)
    val = PackedWindows(tokens[len(tokens) - n_val :], tcfg.seq_len)
    batches = train_batches(train, tcfg.local_batch_size, job_config.job.seed, dp_rank, dp_degree)
    return batches, val


__all__ = ["Tokenizer", "build_data", "build_tokenizer"]
