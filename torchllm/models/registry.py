"""Model registry: a model name maps to its class, flavors and parallelize function.

A new model family is one `register(ModelSpec(...))` call; the trainer, tools and parallelism
code only ever talk to the spec.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from torchllm.config.job_config import ConfigError, document_masking

_REGISTRY: dict[str, "ModelSpec"] = {}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: Callable[[Any], nn.Module]
    flavors: dict[str, Any]
    # parallelize_fn(model, parallel_dims, job_config) applies TP/float8/AC/compile/FSDP|DDP in place.
    parallelize_fn: Callable[..., None]
    # The linear layers (their names inside a block) lora.target_modules may name (models/lora.py).
    lora_targets: tuple[str, ...] = ()

    def build(self, args) -> nn.Module:
        return self.model_cls(args)


def register(spec: ModelSpec) -> None:
    _REGISTRY[spec.name] = spec


def get(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        raise ConfigError(f"model.name = {name!r} is not registered; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def padded_vocab_size(vocab_size: int, multiple: int = 64, pow2: bool = False) -> int:
    """Round the vocab up (to a multiple, or a power of two) for faster matmuls.

    The extra rows never appear as targets: the tokenizer cannot produce their ids.
    """
    if pow2:
        return 1 << math.ceil(math.log2(vocab_size))
    return multiple * math.ceil(vocab_size / multiple)


# [model] keys that replace a field of the flavor's args (unset = the flavor's value).
SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim",
              "ffn_dim_multiplier")


def shape_overrides(job_config, args) -> dict:
    """The [model] shape keys that are set, checked against the family's args fields."""
    mcfg = job_config.model
    known = {f.name for f in dataclasses.fields(args)}
    changes = {}
    for key in SHAPE_KEYS:
        value = getattr(mcfg, key)
        if value is None:
            continue
        if key not in known:
            has = ", ".join(k for k in SHAPE_KEYS if k in known)
            raise ConfigError(
                f"model.{key} = {value}: {mcfg.name} has no {key} (its shape keys: {has}); "
                "unset it", f"model.{key}"
            )
        if value <= 0:
            raise ConfigError(f"model.{key} = {value}: must be positive (unset = the flavor's)",
                              f"model.{key}")
        changes[key] = value
    if "ffn_dim_multiplier" in changes:  # Llama: an explicit width would win over the multiplier
        if "hidden_dim" in changes:
            raise ConfigError(
                "model.hidden_dim and model.ffn_dim_multiplier are both set; set one of the two",
                "model.ffn_dim_multiplier",
            )
        changes["hidden_dim"] = None
    return changes


def model_args(job_config, tokenizer_vocab_size: int | None = None):
    """The flavor's args with the [model] overrides and padding applied.

    The one place config becomes model args: the trainer, launcher pre-flight, tools
    (model_info, estimate_memory, dry_run), evaluation loading and HF export all call it."""
    mcfg = job_config.model
    spec = get(mcfg.name)
    if mcfg.flavor not in spec.flavors:
        raise ConfigError(
            f"model.flavor = {mcfg.flavor!r} is not a flavor of {mcfg.name}; "
            f"known: {', '.join(spec.flavors)}"
        )
    args = spec.flavors[mcfg.flavor]
    shape = shape_overrides(job_config, args)
    vocab = mcfg.vocab_size or tokenizer_vocab_size or args.vocab_size
    if tokenizer_vocab_size is not None and vocab < tokenizer_vocab_size:
        raise ConfigError(
            f"model.vocab_size = {vocab} is smaller than the tokenizer's vocab "
            f"({tokenizer_vocab_size}); unset it or make it >= {tokenizer_vocab_size}"
        )
    masking = document_masking(job_config)  # "auto": block_causal + restart for chat data
    changes = {
        "vocab_size": padded_vocab_size(vocab, mcfg.vocab_pad_multiple, mcfg.vocab_pad_pow2),
        "max_seq_len": mcfg.max_seq_len or job_config.training.seq_len,
        "rope_theta": mcfg.rope_theta,
        "rope_scaling": mcfg.rope_scaling,
        "tie_embeddings": mcfg.tie_embeddings,
        "dropout": mcfg.dropout,
        "attn_mask_type": masking[0],
        "attn_backend": mcfg.attention,
        "sliding_window": tuple(mcfg.sliding_window),
        "restart_positions_per_document": masking[1],
        "moe_bias_update_rate": mcfg.moe_bias_update_rate,
    }
    n_layers = shape.get("n_layers", args.n_layers)
    windows = mcfg.sliding_window
    if (len(windows) not in (0, 1, n_layers) or any(w < 0 for w in windows)
            or len(windows) == 1 and windows[0] == 0):
        raise ConfigError(
            f"model.sliding_window = {windows}: give [] (off), one window W >= 1 for every layer, "
            f"or {n_layers} entries (one per layer of {mcfg.name}/{mcfg.flavor}, 0 = full "
            "attention)", "model.sliding_window"
        )
    known = {f.name for f in dataclasses.fields(args)}
    changes = {k: v for k, v in changes.items() if v is not None and k in known}
    try:
        return dataclasses.replace(args, **changes, **shape)
    except ValueError as e:  # the args' own shape checks (dim % n_heads, n_heads % n_kv_heads)
        if not shape:
            raise
        named = [k for k in shape if re.search(rf"\b{k}=", str(e))] or list(shape)
        given = ", ".join(f"model.{k}={v}" for k, v in shape.items() if v is not None)
        raise ConfigError(f"model.{named[0]}: {e} ({mcfg.name}/{mcfg.flavor} with {given}); "
                          "make the shape keys consistent", f"model.{named[0]}") from None
