"""What every family's Hugging Face adapter shares (each family's own is `models/<family>/hf.py`).

An adapter: the `config.json` it writes, the checks that a Hugging Face config fits a torchllm
model's args, and the state-dict conversion both ways. Conversions are pure reshapes,
transposes, splits and concatenations, so a round trip is bit-identical. Padded vocab rows are
dropped on the way out and zero-filled on the way in.
"""

from __future__ import annotations

import torch

from torchllm.config.job_config import ConfigError

Weights = dict[str, torch.Tensor]


def trim_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return weight[:vocab_size]


def pad_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Zero rows for the padded ids: the tokenizer never produces them."""
    extra = vocab_size - weight.shape[0]
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])])


def expect(key: str, value, ours: str, want) -> None:
    """A Hugging Face config value must equal the torchllm one it maps to."""
    if value != want:
        raise ConfigError(
            f"Hugging Face config {key} = {value!r} but the torchllm model has {ours} = {want!r}; "
            f"pick a flavor or [model] overrides that match the checkpoint"
        )


def check_vocab(hf_vocab: int, vocab_size: int) -> None:
    if hf_vocab > vocab_size:
        raise ConfigError(
            f"Hugging Face config vocab_size = {hf_vocab} is larger than the torchllm model's "
            f"padded vocab {vocab_size}; set model.vocab_size = {hf_vocab} (or unset it)"
        )


def check_tied(hf_tied: bool, tied: bool) -> None:
    if hf_tied != tied:
        raise ConfigError(
            f"Hugging Face config tie_word_embeddings = {hf_tied} but the torchllm model has "
            f"tie_embeddings = {tied}; set model.tie_embeddings = {str(hf_tied).lower()}"
        )
