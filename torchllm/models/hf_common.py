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

# PEFT adapter export (torchllm/hf/peft_names.py) reads three members of an adapter:
#   peft_block   torchllm linear inside a block -> its HF module inside `model.layers.<i>.`;
#                None: the family has no adapter export (peft_refusal says why)
#   peft_roots   torchllm root module -> HF module (the embeddings and head PEFT saves whole)
#   peft_lora_b  (module inside a block, lora_B, args) -> lora_B in HF's layout
# A decoder laid out as transformers' Llama (`model.embed_tokens`, `lm_head`) shares these roots.
LLAMA_LIKE_ROOTS = {"tok_embeddings": "model.embed_tokens", "output": "lm_head"}


def module_names(block: dict[str, str]) -> dict[str, str]:
    """A block's weight-name map (`attention.wq.weight` -> `self_attn.q_proj.weight`) as module
    names (`attention.wq` -> `self_attn.q_proj`): what PEFT's adapters are named after."""
    return {k.removesuffix(".weight"): v.removesuffix(".weight")
            for k, v in block.items() if k.endswith(".weight")}


def same_lora_b(module: str, b: torch.Tensor, args) -> torch.Tensor:
    """lora_B unchanged: the family's export does not permute W's rows."""
    del module, args
    return b


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
