"""Tokenizers and data loaders, built from the [data] config section.

    tokenizer = build_tokenizer(job_config, run_dir / "data")
    train_loader, val_loader = build_data(job_config, tokenizer, dp_rank, dp_degree)

Batches are dicts of LongTensor[B, seq_len]: inputs, targets (inputs shifted by one) and
positions (each token's index within its document). See docs/data.md.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import torch

from torchllm.config.job_config import ConfigError
from torchllm.config.sections import DataSource
from torchllm.data import shards
from torchllm.data.chat import ChatTokenizer, build_chat_source, has_native_template
from torchllm.data.hf_stream import HFStreamBatches, text_digest
from torchllm.data.loader import TrainLoader
from torchllm.data.mixture import MixtureBatches, StreamSource, normalized_weights, source_config
from torchllm.data.sources import documents, open_stream, resolve
from torchllm.data.token_stream import TokenStream, pack_documents
from torchllm.data.tokenizer import Tokenizer, load_tokenizer, train_sentencepiece
from torchllm.data.windows import ValWindows, WindowBatches


def _is_rank0() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _barrier() -> None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def auto_tokenizer_path(dcfg, data_dir: Path) -> Path:
    """Where the auto-trained tokenizer of this dataset and vocab size is cached."""
    name = dcfg.dataset
    if not re.fullmatch(r"[\w.-]+", name):
        slug = re.sub(r"[^\w.-]+", "_", name)[-40:].strip("_")
        name = f"{slug}_{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return Path(data_dir) / f"tokenizer_{name}_sp{dcfg.tokenizer_vocab_size}.model"


def build_tokenizer(job_config, data_dir: Path) -> Tokenizer:
    """Load data.tokenizer; for 'auto', train a SentencePiece model once and cache it.

    In a multi-process run only rank 0 trains and writes it; the others wait at a barrier.
    """
    base = _base_tokenizer(job_config, data_dir)
    dcfg = job_config.data
    chat = any(s.dataset.startswith("chat:") for s in dcfg.sources) or is_chat(dcfg.dataset)
    if (chat or dcfg.chat_tokens) and not has_native_template(base):
        return ChatTokenizer(base)  # + <|user_start|>, ... after the base vocabulary
    return base


def is_chat(dataset: str) -> bool:
    return dataset.startswith("chat:")


def _base_tokenizer(job_config, data_dir: Path) -> Tokenizer:
    dcfg = job_config.data
    if dcfg.sources:  # a mixture: the first source's tokenizer (or corpus, for 'auto')
        dcfg = source_config(dcfg, 0)
    if dcfg.tokenizer != "auto":
        return load_tokenizer(dcfg.tokenizer)
    if is_chat(dcfg.dataset):
        raise ConfigError("data.tokenizer = 'auto' cannot be trained on conversations; name the "
                          "tokenizer (e.g. the base model's)", "data.tokenizer")
    source = resolve(dcfg)
    if source.kind == "shards":
        return load_tokenizer(shards.read_index(source.location)["tokenizer"])
    path = auto_tokenizer_path(dcfg, data_dir)
    if _is_rank0() and not path.is_file():
        train_sentencepiece(documents(dcfg), dcfg.tokenizer_vocab_size, path,
                            max_chars=dcfg.tokenizer_train_chars,
                            source=f"data.dataset = {dcfg.dataset!r}")
    _barrier()
    return load_tokenizer(path)


def tokenize_corpus(dcfg, tokenizer: Tokenizer) -> TokenStream:
    """Every document of an embedded/local corpus, encoded with BOS/EOS and packed in memory."""
    tokens, starts = pack_documents(
        tokenizer.encode(text, bos=True, eos=True) for text in documents(dcfg)
    )
    if len(tokens) == 0:
        raise ConfigError(f"data.dataset = {dcfg.dataset!r} has no text", "data.dataset")
    return TokenStream([tokens], starts)


def whole_stream(dcfg, tokenizer: Tokenizer, max_tokens: int) -> TokenStream:
    """The first max_tokens tokens of a dataset read whole (a dedicated validation set).

    Text sources are tokenized document by document until the budget is reached; a shards
    folder contributes its val split, then its train split.
    """
    source = resolve(dcfg)
    if source.kind == "shards":
        _check_shard_vocab(source.location, tokenizer)
        val, train = (shards.open_split(source.location, s) for s in ("val", "train"))
        parts = [p for s in (val, train) if len(s) for p in s.parts]
        if not parts:
            raise ConfigError(f"{dcfg.dataset!r} holds no tokens", "data.dataset")
        starts = np.concatenate([val.doc_starts, train.doc_starts + len(val)])
        stream = TokenStream(parts, starts)
    else:
        def encoded():
            total = 0
            for text in documents(dcfg):
                if total >= max_tokens:
                    return
                ids = tokenizer.encode(text, bos=True, eos=True)
                total += len(ids)
                yield ids

        tokens, starts = pack_documents(encoded())
        if len(tokens) == 0:
            raise ConfigError(f"{dcfg.dataset!r} has no text", "data.dataset")
        stream = TokenStream([tokens], starts)
    return TokenStream(stream.parts, stream.doc_starts, 0, min(len(stream), max_tokens))


def _check_shard_vocab(location: str, tokenizer: Tokenizer) -> None:
    index = shards.read_index(location)
    if index["vocab_size"] != tokenizer.vocab_size:
        raise ConfigError(
            f"{Path(location) / shards.INDEX}: shards were tokenized with a {index['vocab_size']}-"
            f"token vocab ({index['tokenizer']}), but data.tokenizer has {tokenizer.vocab_size}; "
            "use the shards' tokenizer (data.tokenizer = 'auto' does)", "data.tokenizer"
        )


def build_data(job_config, tokenizer: Tokenizer, dp_rank: int, dp_degree: int):
    """(train_loader, val_loader) for this data-parallel rank.

    train_loader never runs out and resumes exactly from `state_dict()`; val_loader is finite
    and starts over, in the same order, each time it is iterated.
    """
    dcfg, tcfg = job_config.data, job_config.training
    seq_len, batch = tcfg.seq_len, tcfg.local_batch_size
    if dcfg.sources or is_chat(dcfg.dataset):  # a chat: dataset is a mixture of one
        train, val = build_mixture(job_config, tokenizer, dp_rank, dp_degree)
        return _loaders(job_config, train, val, dp_rank, dp_degree)
    source = resolve(dcfg)
    if source.kind == "hf":
        # The first val_documents documents are the validation split; training skips them.
        val_texts = [t for t, _ in zip(documents(dcfg), range(dcfg.val_documents))]
        tokens, starts = pack_documents(tokenizer.encode(t, bos=True, eos=True) for t in val_texts)
        val = TokenStream([tokens], starts)
        _, column = open_stream(source, dcfg.text_column)
        train = HFStreamBatches(source, column, tokenizer, seq_len, batch, dp_rank, dp_degree,
                                held_out=frozenset(text_digest(t) for t in val_texts))
    else:
        if source.kind == "shards":
            _check_shard_vocab(source.location, tokenizer)
            stream, val = (shards.open_split(source.location, s) for s in ("train", "val"))
        else:
            stream = tokenize_corpus(dcfg, tokenizer)
            stream, val = stream.split(len(stream) - int(len(stream) * dcfg.val_fraction))
        train = WindowBatches(stream, seq_len, batch, dp_rank, dp_degree, job_config.job.seed,
                              dcfg.shuffle_windows, dcfg.dataset)
    return _loaders(job_config, train, ValWindows(val, seq_len, dp_rank, dp_degree), dp_rank,
                    dp_degree)


def _loaders(job_config, train, val, dp_rank: int, dp_degree: int):
    dcfg, tcfg = job_config.data, job_config.training
    pin = tcfg.device != "cpu" and torch.cuda.is_available()
    train_loader = TrainLoader(train, dp_rank, dp_degree, dcfg.num_workers, dcfg.prefetch_factor,
                               pin)
    val_loader = torch.utils.data.DataLoader(val, batch_size=tcfg.local_batch_size,
                                             shuffle=False, pin_memory=pin)
    return train_loader, val_loader


def build_mixture(job_config, tokenizer: Tokenizer, dp_rank: int, dp_degree: int):
    """(MixtureBatches, validation windows) of data.sources: each source's own held-out split,
    one after the other."""
    dcfg, seq_len = job_config.data, job_config.training.seq_len
    entries = dcfg.sources or [DataSource(dcfg.dataset, 1.0)]
    weights = normalized_weights(entries)
    sources, vals = [], []
    for i, entry in enumerate(entries):
        one = source_config(dcfg, i) if dcfg.sources else dcfg
        where = f"data.sources[{i}] ({entry.dataset})" if dcfg.sources else "data.dataset"
        # Each source its own seed, so equal sources still read in different orders.
        seed = job_config.job.seed + 1_000_003 * (i + 1)
        try:
            if is_chat(entry.dataset):
                source, val = build_chat_source(entry.dataset[len("chat:"):], job_config,
                                                tokenizer, dp_rank, dp_degree, seed)
                sources.append(source)
                vals.append(val)
                continue
            kind = resolve(one).kind
            if kind == "hf":
                raise ConfigError("Hugging Face streams cannot be mixed yet; write them to shards "
                                  "first (python -m torchllm.data.prepare) and mix shards:DIR")
            if kind == "shards":
                location = resolve(one).location
                _check_shard_vocab(location, tokenizer)
                stream, val = (shards.open_split(location, s) for s in ("train", "val"))
            else:
                stream = tokenize_corpus(one, tokenizer)
                stream, val = stream.split(len(stream) - int(len(stream) * dcfg.val_fraction))
            sources.append(StreamSource(stream, seq_len, seed, dcfg.shuffle_windows,
                                        entry.dataset))
        except ConfigError as e:
            said = str(e) if str(e).startswith(f"{where}:") else f"{where}: {e}"
            raise ConfigError(said, e.key or "data.sources") from None
        vals.append(ValWindows(val, seq_len, dp_rank, dp_degree))
    train = MixtureBatches(sources, [s.dataset for s in entries], weights,
                           job_config.training.local_batch_size, dp_rank, dp_degree)
    return train, torch.utils.data.ConcatDataset(vals)


__all__ = ["MixtureBatches", "Tokenizer", "build_data", "build_tokenizer", "load_tokenizer",
           "whole_stream"]
