"""data.tokenizer = "from_initial_load": a new stage (mid-training, SFT) uses the tokenizer the run
at checkpoint.initial_load_path trained with, as that checkpoint's COMPLETE marker records it
(vocab_resize.tokenizer_record: the base tokenizer's file or Hub name, its SHA-256, and whether
the 6 chat tokens were added). So a stage config does not name the previous stage's tokenizer
file (which an 'auto' tokenizer's path-derived name would make the user look up).

The Trainer resolves it before anything else, so the run's config.toml (and each step's) records
the concrete tokenizer: generate, the evals, export and the next stage read it from there.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from torchllm.checkpoint.layout import MARKER, MarkerError, read_marker, resolve_checkpoint
from torchllm.config.job_config import ConfigError
from torchllm.log import logger

FROM_INITIAL_LOAD = "from_initial_load"
SAID = f"data.tokenizer = {FROM_INITIAL_LOAD!r}"


def _recorded(ccfg) -> tuple[str, bool, str]:
    """(tokenizer spec, chat tokens added, where it is recorded) of initial_load_path's run."""
    if ccfg.initial_load_in_hf:  # a transformers folder: its own tokenizer.json
        spec = Path(ccfg.initial_load_path) / "tokenizer.json"
        if not spec.is_file():
            raise ConfigError(f"{SAID}: the Hugging Face folder {ccfg.initial_load_path} has no "
                              "tokenizer.json; name the model's tokenizer in data.tokenizer",
                              "data.tokenizer")
        return str(spec), False, str(ccfg.initial_load_path)
    try:
        step = resolve_checkpoint(ccfg.initial_load_path)
        record = read_marker(step).get("tokenizer")
    except (FileNotFoundError, MarkerError) as e:
        raise ConfigError(f"{SAID} reads checkpoint.initial_load_path's tokenizer: {e}",
                          "checkpoint.initial_load_path") from None
    marker = step / MARKER
    if not record:
        raise ConfigError(f"{SAID}: {marker} records no tokenizer (written before checkpoints "
                          "recorded theirs); name the tokenizer that run trained with in "
                          "data.tokenizer (its config.toml's data.tokenizer)", "data.tokenizer")
    spec, digest = record["name"], record.get("base_sha256")
    if digest is not None:  # a file: it must still be there, unchanged
        path = Path(spec)
        if not path.is_file():
            raise ConfigError(f"{SAID}: the tokenizer file {spec} recorded in {marker} is gone "
                              "(a relative path is from the folder training ran in); name the "
                              "file in data.tokenizer", "data.tokenizer")
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise ConfigError(f"{SAID}: the tokenizer file {spec} changed since the run at "
                              f"{ccfg.initial_load_path} trained with it (SHA-256 recorded in "
                              f"{marker}); restore it or name another in data.tokenizer",
                              "data.tokenizer")
    return spec, bool(record.get("chat_tokens")), str(marker)


def stage_tokenizer(cfg, log: bool = False):
    """`cfg` with data.tokenizer = 'from_initial_load' replaced by the recorded tokenizer (and
    data.chat_tokens on when that run had them: its vocabulary cannot shrink); else `cfg`.
    ConfigError (one line) when there is nothing to read it from. An empty
    checkpoint.initial_load_path is refused earlier, by the config's own validation."""
    if cfg.data.tokenizer != FROM_INITIAL_LOAD:
        return cfg
    spec, chat, where = _recorded(cfg.checkpoint)
    if log:
        logger.info("%s: %s%s, as recorded in %s", SAID, spec, " + the 6 chat tokens" * chat,
                    where)
    data = dataclasses.replace(cfg.data, tokenizer=spec, chat_tokens=cfg.data.chat_tokens or chat)
    return dataclasses.replace(cfg, data=data)
