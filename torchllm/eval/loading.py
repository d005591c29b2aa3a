"""Load a trained model for inference from a run folder and its DCP checkpoints.

Layout (written by the trainer and the checkpointer):
    <run_dir>/config.toml                     the effective config of the run
    <run_dir>/data/                           the tokenizer cache (read, never trained here)
    <run_dir>/checkpoint/step-<N>/            a torch.distributed.checkpoint directory whose
                                              state dict maps "model" to the model's state_dict()
    <run_dir>/checkpoint/step-<N>/COMPLETE    written once every rank finished saving
    <run_dir>/checkpoint/step-<N>/config.toml the config that step was written under: it wins
                                              over the run's (a later launch may have changed
                                              that one)
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from torchllm import models
from torchllm.checkpoint import Step, open_checkpoint
from torchllm.run.tokenizer import inference_tokenizer
from torchllm.config import ConfigError, JobConfig
from torchllm.config.loader import parse_cli
from torchllm.data import Tokenizer
from torchllm.device import resolve_device
from torchllm.models.lora import TOKEN_DELTA, added_tokens, build_with_lora, init_weights
from torchllm.ranks import env_world_size

CHECKPOINT_HELP = "run folder (its latest complete step), its checkpoint/ folder, or a step folder"
OVERRIDES_HELP = ("Other --section.key=value arguments override the run's config, as for training "
                  "(e.g. --eval.hellaswag_data=hellaswag_val.jsonl).")


def parse_args_and_overrides(parser: argparse.ArgumentParser, argv: list[str] | None,
                             hints: dict[str, str] | None = None
                             ) -> tuple[argparse.Namespace, list[str]]:
    """The CLI's own options, and the other arguments as `--section.key=value` config overrides.

    `parser` must have `allow_abbrev=False` (else `--data` would silently mean `--data-dir`).
    An argument that is neither raises ConfigError; `hints` maps such an option to what to use.
    """
    assert not parser.allow_abbrev, "abbreviations would swallow unknown options"
    args, rest = parser.parse_known_args(argv)
    for arg in rest:
        flag = arg.split("=", 1)[0]
        if flag in (hints or {}):
            raise ConfigError(f"command line: {flag} is not an option of {parser.prog}; "
                              f"{hints[flag]}", flag)
    parse_cli(rest)  # raises ConfigError naming an argument that is not an override
    return args, rest


def load_for_inference(
    path: str | Path | Step, device: torch.device | str, overrides: list[str] = ()
) -> tuple[nn.Module, JobConfig, Tokenizer]:
    """(model in eval mode on `device`, the run's config, its tokenizer) from a checkpoint (a
    run, checkpoint or step folder, or a step the checkpoint reader already opened).

    `overrides` (`--section.key=value`) apply on top of the run's config, as for training.
    """
    reader = path if isinstance(path, Step) else open_checkpoint(path)
    cfg = reader.config(overrides)  # the checkpoint's, as data: no code imported from it
    models.check_family(reader.saved_config_text(), cfg.model.name, f"checkpoint {reader.path}")
    tokenizer = inference_tokenizer(cfg.data, cfg.checkpoint, reader,
                                    reader.run_folder(cfg.job) / "data")
    spec = models.get(cfg.model.name)
    with torch.device("meta"):  # (a LoRA run's model has its adapters: models/lora.py)
        args = models.model_args(cfg.model, cfg.training, cfg.data, tokenizer.vocab_size)
        model = build_with_lora(spec, args, cfg.lora, cfg.model, cfg.float8.enable,
                                _saved_token_rows(reader, tokenizer))
    model.to_empty(device=device)
    init_weights(model, buffer_device=torch.device(device))  # buffers (RoPE) are not saved
    state = model.state_dict()
    with warnings.catch_warnings():  # one process without a group is the intended use here
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        reader.read({"model": state})
    model.load_state_dict(state)
    model.eval()
    return model, cfg, tokenizer


def _saved_token_rows(reader: Step, tokenizer) -> tuple[int, int] | None:
    """A LoRA run's trainable token rows (lora.train_new_tokens) when its checkpoint has them
    (one saved before they existed has none)."""
    new = added_tokens(tokenizer)
    return new if new and any(
        k.endswith(f".{TOKEN_DELTA}") for k in reader.metadata.state_dict_metadata) else None


def inference_device(name: str) -> torch.device:
    """'auto' = CUDA when present (this rank's GPU under torchrun), else CPU."""
    device = resolve_device(name, key="--device")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def init_distributed(device: torch.device) -> None:
    """Join the process group when launched by torchrun with more than one process."""
    if env_world_size() > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
