"""Hugging Face folders into torchllm: a seed checkpoint (`python -m torchllm.hf import`), or a
run's initial weights (`checkpoint.initial_load_in_hf = true`: `load_initial_weights`).

`import` writes a complete weights-only DCP checkpoint for the model the given config describes
(usable as `checkpoint.initial_load_path`), with the folder's tokenizer and the config naming
it, written beside the output and renamed when complete.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from torchllm import models
from torchllm.checkpoint import EXPORT_DTYPES, step_of
from torchllm.models import adapter_for_hf, adapter_for_model
from torchllm.checkpoint.stage.tokenizer_identity import check_same_tokenizer
from torchllm.checkpoint.stage.tokenizer_identity import hf_record
from torchllm.config import ConfigError, load_config, to_toml
from torchllm.hf.files import refuse_step_folder, save_seed_checkpoint
from torchllm.hf.folder import read_hf_config, read_hf_weights
from torchllm.hf_folder import has_file, hf_store, tokenizer_bytes
from torchllm.hf.validate import (
    ReadTracker, check_all_read, check_cast, check_converted, check_shapes, expected_shapes,
)
from torchllm.log import logger
from torchllm.models.contract import LanguageModel
from torchllm.store import Store


def convert_from_hf(hf_dir, adapter, args) -> dict[str, torch.Tensor]:
    """A HF folder's weights (a path, or its Store: every file read through it) as the state
    dict of the torchllm model `args` describes."""
    hf_dir = hf_store(hf_dir)
    hf_config = read_hf_config(hf_dir)
    if adapter_for_hf(hf_config) is not adapter:
        raise ConfigError(f"{hf_dir.root} holds a {hf_config['model_type']!r} model, not a "
                          f"{adapter.model_type!r} one; set model.name to match")
    try:
        adapter.check(hf_config, args)
    except KeyError as e:
        raise ValueError(f"{hf_dir.where('config.json')} lacks {e.args[0]!r}, which a "
                         f"{adapter.model_type} config has") from None
    vocab = hf_config["vocab_size"]  # a positive int (read_hf_config), <= args' (adapter.check)
    weights = read_hf_weights(hf_dir)  # float dtypes, finite values
    weights = ReadTracker(getattr(adapter, "hf_names", lambda w: w)(weights))
    check_shapes(weights, expected_shapes(adapter, args, vocab), hf_dir.root, vocab)
    try:
        converted = adapter.from_hf(weights, args)
    except KeyError as e:
        raise ValueError(f"{hf_dir.root}: the weights lack {e.args[0]!r}, which its config "
                         "implies") from None
    check_all_read(weights, hf_dir.root)
    check_converted(converted, adapter, args, hf_dir.root)
    return converted


def import_hf(hf_dir: str | Path, out_dir: str | Path, overrides: list[str] = (),
              dtype: str = "float32", overwrite: bool = False) -> Path:
    """Write a complete weights-only DCP checkpoint (a seed checkpoint) from a HF folder."""
    out = Path(out_dir)
    step = step_of(out)
    if step is None:
        raise ValueError(f"{out}: the output folder must be named step-<N> (e.g. .../step-0)")
    refuse_step_folder(out, overwrite)
    cfg = load_config(list(overrides))
    hf_dir = hf_store(hf_dir)  # the folder, opened once: every file read through it
    hf_vocab = read_hf_config(hf_dir)["vocab_size"]  # checked: a positive int
    args = models.model_args(cfg.model, cfg.training, cfg.data, hf_vocab)
    weights = convert_from_hf(hf_dir, adapter_for_model(cfg.model.name), args)
    weights = {k: v.to(EXPORT_DTYPES[dtype]).contiguous() for k, v in weights.items()}
    check_cast(weights, dtype, hf_dir.root)  # before anything is written

    def seed_files(tmp: Path) -> dict:  # the seed's tokenizer, and the config.toml naming it
        info, data, model = _seed_tokenizer(hf_dir, out, tmp, cfg.data, cfg.model, hf_vocab)
        (tmp / "config.toml").write_text(to_toml(dataclasses.replace(cfg, data=data, model=model)))
        return info

    save_seed_checkpoint(weights, out, step, seed_files)
    logger.info("imported %s as %s/%s (vocab %d padded to %d) into %s", hf_dir.root,
                cfg.model.name, cfg.model.flavor, hf_vocab, args.vocab_size, out)
    return out


def _seed_tokenizer(hf_dir: Store, out: Path, tmp: Path, dcfg, mcfg, hf_vocab: int
                    ) -> tuple[dict, object, object]:
    """Into the seed checkpoint `out` (being written in `tmp`): the HF folder's tokenizer files
    (else the [data] section `dcfg`'s named tokenizer), as training writes them, so generate
    reads the seed like a run's step and a stage from it takes its tokenizer (data.tokenizer =
    'auto' / 'from_initial_load'); returns (the marker's tokenizer record, the [data] and
    [model] sections (`mcfg`'s) its config.toml records: naming that tokenizer, the seed's
    vocab)."""
    from torchllm.checkpoint.stage.tokenizer_identity import (
        FROM_INITIAL_LOAD, NEW, hf_folder_tokenizer, tokenizer_record,
    )
    from torchllm.data import build_tokenizer

    found = hf_folder_tokenizer(hf_dir)
    named = dcfg.tokenizer not in ("auto", NEW, FROM_INITIAL_LOAD)
    info, data = {}, dcfg
    if found is not None:
        file, chat = found
        for name in (file.name, "tokenizer_config.json"):  # bounded, no link followed
            if has_file(hf_dir, name):
                (tmp / name).write_bytes(tokenizer_bytes(hf_dir, name))
        if named:
            logger.info("recorded %s's own tokenizer %s (not the config's data.tokenizer = %r)",
                        hf_dir.root, file.name, dcfg.tokenizer)
        data = dataclasses.replace(data, tokenizer=str(tmp / file.name), chat_tokens=chat)
    elif not named:
        logger.warning("%s has no tokenizer.json or tokenizer.model and the config names none: "
                       "the seed records no tokenizer (name it in data.tokenizer to use the "
                       "seed)", hf_dir.root)
    if found is not None or named:
        tokenizer = build_tokenizer(data, tmp, train=False)
        if tokenizer.vocab_size > hf_vocab:
            raise ConfigError(f"the tokenizer {data.tokenizer} has {tokenizer.vocab_size} ids, "
                              f"more than {hf_dir.root}'s vocab_size = {hf_vocab}", "data.tokenizer")
        info["tokenizer"] = record = tokenizer_record(tokenizer)
        if found is not None:  # named as it will be: the finished seed's copy, absolute (a
            # run from the seed may start in another directory)
            data = dataclasses.replace(data, tokenizer=str(out.absolute() / found[0].name))
            record["name"] = data.tokenizer
    model = mcfg
    if not model.vocab_size and (not info or info["tokenizer"]["vocab_size"] != hf_vocab):
        model = dataclasses.replace(model, vocab_size=hf_vocab)  # the seed's rows, not fewer
    return info, data, model


def load_hf_weights(model: LanguageModel, hf_dir) -> None:
    """Initialize a (possibly sharded) model in place from a HF folder.

    Every rank reads the full tensors (safetensors maps them lazily) and keeps its own shards.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    hf_dir = hf_store(hf_dir)  # the folder, opened once: every file read through it
    adapter = adapter_for_hf(read_hf_config(hf_dir))
    if not isinstance(model, adapter.model_cls):
        raise ConfigError(f"{hf_dir.root} holds a {adapter.model_type!r} model but the run builds a "
                          f"{type(model).__name__}; set model.name to match")
    weights = convert_from_hf(hf_dir, adapter, model.args)
    options = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(model, weights, options=options)


def load_initial_weights(model: LanguageModel, hf_dir: str | Path, tokenizer: dict | None) -> None:
    """A run's initial weights from a Hugging Face folder (checkpoint.initial_load_in_hf), once
    the folder's tokenizer is the run's (`tokenizer`: the run's tokenizer record; the
    checkpoint reader's one identity check)."""
    hf_dir = hf_store(hf_dir)
    try:
        check_same_tokenizer(hf_record(hf_dir), tokenizer,
                             f"the Hugging Face folder {hf_dir.root}", "initial load")
        load_hf_weights(model, hf_dir)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:  # the folder's files: one line, exit 2 (not a traceback)
        raise ConfigError(f"checkpoint.initial_load_path = {hf_dir.root} (a Hugging Face "
                          f"folder): {e}", "checkpoint.initial_load_path") from None
