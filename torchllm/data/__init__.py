"""Tokenizers and data loaders, built from the [data] config section.

    data = parse_data(cfg.data)                       # the [data] section, parsed once
    tokenizer = tokenizer_of(data, run_dir / "data")  # or both: build_tokenizer(cfg.data, ...)
    batching = Batching.of(cfg.training, cfg.job, cfg.model)
    train_loader, val_loader = build_data(cfg.data, cfg.validation, batching, tokenizer,
                                          dp_rank, dp_degree)

Batches are dicts of LongTensor[B, seq_len]: inputs, targets (inputs shifted by one) and
positions (each token's index within its document). What `data.dataset` (or each
`[[data.sources]]` entry) may be: a source (torchllm/data/sources/: one module per source, one
registry) read with a packing (torchllm/data/packing/: text windows, or conversations), or a
mixture of them (torchllm/data/dataset.py, mixture.py). See docs/data.md.
"""

from __future__ import annotations

import copy
import hashlib
import re
from pathlib import Path

import torch

from torchllm.config.job_config import ConfigError, reads_conversations
from torchllm.data.chat.tokens import ChatTokenizer, has_native_template
from torchllm.data.dataset import check_data, parse_data, parse_dataset
from torchllm.data.loader import TrainLoader
from torchllm.data.mixture import MixtureBatches
from torchllm.data.sources.base import Batching, Context
from torchllm.data.token_stream import TokenStream
from torchllm.data.tokenizer import Tokenizer, load_tokenizer
from torchllm.data.tokenizer_training import train_sentencepiece
from torchllm.ranks import barrier as _barrier, is_rank0 as _is_rank0


def auto_tokenizer_path(dcfg, data_dir: Path) -> Path:
    """Where the auto-trained tokenizer of this dataset and vocab size is cached."""
    name = dcfg.dataset
    if not re.fullmatch(r"[\w.-]+", name):
        slug = re.sub(r"[^\w.-]+", "_", name)[-40:].strip("_")
        name = f"{slug}_{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return Path(data_dir) / f"tokenizer_{name}_sp{dcfg.tokenizer_vocab_size}.model"


def build_tokenizer(dcfg, data_dir: Path, train: bool = True) -> Tokenizer:
    """The tokenizer of the [data] section `dcfg` (see `tokenizer_of`)."""
    return tokenizer_of(parse_data(dcfg), data_dir, train)


def tokenizer_of(data, data_dir: Path, train: bool = True) -> Tokenizer:
    """The tokenizer of `data`, the data config parsed once (parse_data: a Dataset or a
    Mixture): data.tokenizer; for 'auto', the data's own (shards) or a SentencePiece model
    trained once on its (first source's) text and cached; for 'train', always the trained one;
    with the chat tokens added for conversations (or data.chat_tokens) unless it has a template.

    In a multi-process run only rank 0 trains and writes it; the others wait at a barrier.
    A stage's data.tokenizer ('from_initial_load', or 'auto' with checkpoint.initial_load_path)
    arrives resolved to the initial load's (torchllm/run/tokenizer.py). train=False (inference:
    the config a checkpoint was written under): 'auto' is the run's cached file, never trained.
    """
    file = _tokenizer_file(data.tokenizer_source(), data_dir, train)
    base = load_tokenizer(file)
    if (data.chat or data.dcfg.chat_tokens) and not has_native_template(base):
        return ChatTokenizer(base)  # + <|user_start|>, ... after the base vocabulary
    return base


def _tokenizer_file(dataset, data_dir: Path, train: bool):
    """What the base tokenizer is loaded from: data.tokenizer when it names one; for 'auto', the
    data's own (shards) if it carries one; else the SentencePiece model cached in `data_dir`,
    trained first (rank 0; the others wait) when training and missing."""
    dcfg = dataset.dcfg
    if dcfg.tokenizer not in ("auto", "train"):
        return dcfg.tokenizer
    path = auto_tokenizer_path(dcfg, data_dir)
    carried = dataset.carried_tokenizer() if dcfg.tokenizer == "auto" else None
    if carried is not None:
        return carried
    if not train:
        if not path.is_file():
            raise ConfigError(
                f"the run's tokenizer {path} is missing (data.tokenizer = {dcfg.tokenizer!r}: "
                "training trained it on data.dataset and cached it there; loading a checkpoint "
                "never trains one): copy that file from the run's data/ folder where it trained, "
                "or pass --data.tokenizer=FILE", "data.tokenizer")
        return path
    texts = dataset.texts()  # on every rank: data without text says so before the barrier
    if _is_rank0() and not path.is_file():
        train_sentencepiece(texts, dcfg.tokenizer_vocab_size, path,
                            max_chars=dcfg.tokenizer_train_chars,
                            source=f"data.dataset = {dcfg.dataset!r}")
    _barrier()
    return path


def whole_stream(dcfg, tokenizer: Tokenizer, max_tokens: int) -> TokenStream:
    """A dataset read whole (a dedicated validation set): all its tokens, so that validation
    can score windows spread over all of it (torchllm.eval.in_training.spread_ids); a stream
    (rows read as they arrive, size unknown: hf:) only its first max_tokens.

    Text sources are tokenized document by document; a shards folder contributes its val
    split, then its train split.
    """
    dataset = parse_dataset(dcfg)
    return dataset.whole_stream(tokenizer, max_tokens if dataset.source.streams else None)


def dedicated_validation(dcfg, vcfg) -> bool:
    """Whether validation reads a set of its own (validation.dataset, other than data.dataset)
    instead of a split held out of the training data (`dcfg`, `vcfg`: the [data] and
    [validation] sections)."""
    return bool(vcfg.dataset) and vcfg.dataset != dcfg.dataset and not vcfg.split


def holds_out(dcfg, vcfg) -> bool:
    """Whether the training data holds a validation split out (data.val_fraction of a corpus
    or of conversations, data.val_documents of a stream): only when validation is on and
    reads that split. With validation off, or a dedicated validation.dataset, every window
    trains (shards keep their own val files, never trained either way)."""
    return vcfg.enable and not dedicated_validation(dcfg, vcfg)


def training_data(dcfg, vcfg):
    """The [data] section `dcfg`, or, when nothing is held out (`holds_out`: validation off, or
    a dedicated validation.dataset), a copy that holds nothing out (data.val_fraction and
    data.val_documents 0): a split validation never reads would only be text withheld from
    training for nothing."""
    if holds_out(dcfg, vcfg):
        return dcfg
    out = copy.deepcopy(dcfg)
    out.val_fraction, out.val_documents = 0.0, 0
    return out


def build_data(dcfg, vcfg, batching: Batching, tokenizer: Tokenizer, dp_rank: int,
               dp_degree: int):
    """(train_loader, val_loader) for this data-parallel rank, of the [data] section `dcfg`
    (what the [validation] section `vcfg` holds out of it: `training_data`) cut into
    `batching`'s windows and batches.

    train_loader never runs out and resumes exactly from `state_dict()`; val_loader is finite
    and starts over, in the same order, each time it is iterated: all the held-out windows, the
    same on every rank (evaluation shares them out: torchllm.eval.in_training.HeldOutBatches).
    """
    dcfg = training_data(dcfg, vcfg)
    data = parse_data(dcfg)
    ctx = Context(dcfg, batching, tokenizer, dp_rank, dp_degree, batching.seed)
    train, val = data.batches(ctx)
    pin = batching.pin_memory
    train_loader = TrainLoader(train, dp_rank, dp_degree, dcfg.num_workers, dcfg.prefetch_factor,
                               pin, packed_chat=reads_conversations(dcfg))
    val_loader = torch.utils.data.DataLoader(val, batch_size=batching.batch_size,
                                             shuffle=False, pin_memory=pin)
    return train_loader, val_loader


__all__ = ["Batching", "MixtureBatches", "Tokenizer", "build_data", "build_tokenizer",
           "check_data",
           "dedicated_validation", "holds_out", "load_tokenizer", "parse_data", "tokenizer_of",
           "whole_stream"]
