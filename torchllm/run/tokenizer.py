"""The run's tokenizer, resolved once: a stage's is its initial load's.

data.tokenizer = "from_initial_load", or "auto" (the default) with checkpoint.initial_load_path
set: a new stage (mid-training, SFT) uses the tokenizer of the model it starts from, as that
checkpoint's COMPLETE marker records it (checkpoint/stage/tokenizer_identity.py: the base tokenizer's
file or Hub name, its SHA-256, and whether the 6 chat tokens were added), or for a Hugging Face
folder (checkpoint.initial_load_in_hf) the folder's own tokenizer file. data.tokenizer = "train"
trains a new one on data.dataset instead (a warning at the initial load: the loaded embedding
rows then mean other tokens). The run resolves it before anything else (torchllm.run.resolve),
so the run's config.toml (and each step's) records the concrete tokenizer: generate, the evals,
export and the next stage read it from there, and never train one (inference_tokenizer). The
launcher's config check calls `stage_tokenizer` too (a one-line error before any process
starts); data/ only ever sees a concrete data.tokenizer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torchllm.checkpoint.layout import MARKER
from torchllm.checkpoint.step import MarkerError, read_marker, resolve_checkpoint
from torchllm.storage import join
from torchllm.checkpoint.stage.tokenizer_identity import (
    FROM_INITIAL_LOAD,
    NEW,
    hf_folder_tokenizer,
    sha256_of,
    tokenizer_record,
)
from torchllm.config.job_config import ConfigError
from torchllm.data import build_tokenizer
from torchllm.log import logger


def _said(dcfg) -> str:
    if dcfg.tokenizer == FROM_INITIAL_LOAD:
        return f"data.tokenizer = {FROM_INITIAL_LOAD!r}"
    return "data.tokenizer = 'auto' with checkpoint.initial_load_path"


def _recorded(dcfg, ccfg) -> tuple[str, bool, str]:
    """(tokenizer spec, chat tokens added, where it is recorded) of initial_load_path's run
    (`dcfg`, `ccfg`: the [data] and [checkpoint] sections)."""
    said = _said(dcfg)
    other = f"name the model's tokenizer in data.tokenizer, or set data.tokenizer = {NEW!r} to " \
            "train a new one on data.dataset"
    if ccfg.initial_load_in_hf:  # a transformers folder: its own tokenizer file
        found = hf_folder_tokenizer(ccfg.initial_load_path)
        if found is None:
            raise ConfigError(f"{said}: the Hugging Face folder {ccfg.initial_load_path} has no "
                              f"tokenizer.json or tokenizer.model; {other}", "data.tokenizer")
        return str(found[0]), found[1], str(ccfg.initial_load_path)
    try:
        step = resolve_checkpoint(ccfg.initial_load_path)
        record = read_marker(step).get("tokenizer")
    except (FileNotFoundError, MarkerError) as e:
        raise ConfigError(f"{said} reads checkpoint.initial_load_path's tokenizer: {e}",
                          "checkpoint.initial_load_path") from None
    marker = join(step, MARKER)
    if not record:
        raise ConfigError(f"{said}: {marker} records no tokenizer (written before checkpoints "
                          "recorded theirs, or by convert to-dcp); name the tokenizer that run "
                          f"trained with in data.tokenizer (its config.toml's data.tokenizer), or "
                          f"set data.tokenizer = {NEW!r} to train a new one on data.dataset",
                          "data.tokenizer")
    spec, digest = record["name"], record.get("base_sha256")
    if digest is not None:  # a file: it must still be there, unchanged
        path = Path(spec)
        if not path.is_file():
            raise ConfigError(f"{said}: the tokenizer file {spec} recorded in {marker} is gone "
                              "(a relative path is from the folder training ran in); name the "
                              "file in data.tokenizer", "data.tokenizer")
        if sha256_of(path) != digest:
            raise ConfigError(f"{said}: the tokenizer file {spec} changed since the run at "
                              f"{ccfg.initial_load_path} trained with it (SHA-256 recorded in "
                              f"{marker}); restore it or name another in data.tokenizer",
                              "data.tokenizer")
    return spec, bool(record.get("chat_tokens")), str(marker)


def inherits(dcfg, ccfg) -> bool:
    """Whether data.tokenizer is the initial load's: 'from_initial_load', or 'auto' for a stage
    (`dcfg`, `ccfg`: the [data] and [checkpoint] sections)."""
    tok = dcfg.tokenizer
    return tok == FROM_INITIAL_LOAD or (tok == "auto" and bool(ccfg.initial_load_path))


def stage_tokenizer(dcfg, ccfg, log: bool = False, auto: bool = True):
    """The [data] section `dcfg` with an inherited data.tokenizer (see `inherits`; `ccfg`: the
    [checkpoint] section; `auto`=False: 'from_initial_load' only) replaced by the initial load's
    concrete tokenizer (and data.chat_tokens on when that run had them: its vocabulary cannot
    shrink); else `dcfg`. ConfigError (one line) when there is nothing to read it from. An
    empty checkpoint.initial_load_path with 'from_initial_load' is refused earlier, by the
    config's own validation."""
    if not inherits(dcfg, ccfg) or (not auto and dcfg.tokenizer != FROM_INITIAL_LOAD):
        return dcfg
    spec, chat, where = _recorded(dcfg, ccfg)
    if log:
        logger.info("%s: %s%s, as recorded in %s", _said(dcfg), spec,
                    " + the 6 chat tokens" * chat, where)
    return dataclasses.replace(dcfg, tokenizer=spec, chat_tokens=dcfg.chat_tokens or chat)


def inference_tokenizer(dcfg, ccfg, reader, data_dir: Path):
    """The tokenizer of the checkpoint step `reader` (checkpoint.Step) for generate,
    the evals and export: the [data] section `dcfg`'s (of the config the step was written
    under; `ccfg` its [checkpoint] section), never trained here ('auto': the run's cached file,
    else one line naming it), and checked against the step's recorded tokenizer
    (reader.check_tokenizer)."""
    tokenizer = build_tokenizer(stage_tokenizer(dcfg, ccfg, auto=False), data_dir, train=False)
    reader.check_tokenizer(tokenizer_record(tokenizer), "inference")
    return tokenizer


def trains_new_tokenizer(dcfg, ccfg) -> bool:
    """A stage that trains its own tokenizer on purpose (data.tokenizer = 'train' with
    checkpoint.initial_load_path; `dcfg`, `ccfg`: the [data] and [checkpoint] sections): the
    initial load warns instead of refusing it."""
    return dcfg.tokenizer == NEW and bool(ccfg.initial_load_path)
