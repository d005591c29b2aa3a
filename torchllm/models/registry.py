"""Model registry: a model name maps to its family's `ModelSpec` (torchllm/models/spec.py).

A new model family is one folder (`torchllm/models/<family>/`) and one `register(...)` line
(torchllm/models/__init__.py; a family outside the package registers itself in the module that
`job.custom_import` names, imported when the config is loaded). The trainer, tools, HF interop
and parallelism code only ever talk to the spec.
"""

from __future__ import annotations

import dataclasses
import math
import re

from torch import nn

from torchllm.config import components
from torchllm.config.job_config import ConfigError, document_masking
from torchllm.config.sections import Model
from torchllm.models.spec import ModelSpec

_REGISTRY: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> None:
    """Add a family; its own [model] keys (spec.config) must be fields of its args (a key
    replaces the args field of its name). The loader accepts them when model.name selects it."""
    unknown = []
    for flavor, args in spec.flavors.items():
        fields = {f.name for f in dataclasses.fields(args)}
        unknown += [f"{k} (not a field of {flavor}'s args)" for k in spec.shape_keys
                    if k not in fields]
    if unknown:
        raise ValueError(f"model {spec.name!r}: its [model] keys {unknown} are not fields of "
                         f"its args; a key of {spec.config.__name__} replaces the args field "
                         "of its name")
    components.declare("model", spec.name, Model, spec.config)
    _REGISTRY[spec.name] = spec


def get(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        raise ConfigError(f"model.name = {name!r} is not registered; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def spec_of(model: nn.Module) -> ModelSpec:
    """The spec whose model class `model` is (or subclasses: FSDP2 wraps the class)."""
    for cls in type(model).__mro__:
        for spec in _REGISTRY.values():
            if spec.model_cls is cls:
                return spec
    raise ValueError(f"{type(model).__name__} is not the model of a registered family "
                     f"({', '.join(_REGISTRY)}); register its ModelSpec")


def hf_adapters() -> dict:
    """model name -> its family's Hugging Face adapter, for the families that have one."""
    return {name: s.hf_adapter for name, s in _REGISTRY.items() if s.hf_adapter is not None}


def adapter_for_model(model_name: str):
    """The family's Hugging Face adapter (models/<family>/hf.py)."""
    adapters = hf_adapters()
    if model_name not in adapters:
        raise ConfigError(f"model.name = {model_name!r} has no Hugging Face conversion; "
                          f"supported: {', '.join(adapters)}")
    return adapters[model_name]


def adapter_for_hf(hf_config: dict):
    """The adapter of a Hugging Face config's model_type."""
    by_type = {}  # the first family registered for a model_type reads it (a variant may share it)
    for spec in _REGISTRY.values():
        if spec.hf_adapter is not None:
            by_type.setdefault(spec.hf_adapter.model_type, spec.hf_adapter)
    kind = hf_config.get("model_type")
    if kind not in by_type:
        raise ConfigError(f"Hugging Face model_type {kind!r} is not supported; "
                          f"supported: {', '.join(by_type)}")
    return by_type[kind]


def padded_vocab_size(vocab_size: int, multiple: int = 64, pow2: bool = False) -> int:
    """Round the vocab up (to a multiple, or a power of two) for faster matmuls.

    The extra rows never appear as targets: the tokenizer cannot produce their ids.
    """
    if pow2:
        return 1 << math.ceil(math.log2(vocab_size))
    return multiple * math.ceil(vocab_size / multiple)


def own_values(mcfg) -> dict:
    """The [model] values set beyond the keys every family shares: the family's own keys (and,
    in a config built in code, any attribute set on the section)."""
    shared = {f.name for f in dataclasses.fields(Model)}
    return {k: v for k, v in vars(mcfg).items() if k not in shared and v is not None}


def shape_overrides(mcfg, spec: ModelSpec) -> dict:
    """The family's own [model] keys that are set (the [model] section `mcfg`), checked."""
    known = spec.shape_keys
    changes = {}
    for key, value in own_values(mcfg).items():
        if key not in known:
            raise ConfigError(
                f"model.{key} = {value}: {mcfg.name} has no {key} (its shape keys: "
                f"{', '.join(known)}); unset it", f"model.{key}"
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


def model_args(mcfg, tcfg, dcfg, tokenizer_vocab_size: int | None = None):
    """The flavor's args with the [model] overrides and padding applied.

    The one place config becomes model args: the trainer, launcher pre-flight, tools
    (model_info, estimate_memory, dry_run), evaluation loading and HF export all call it with
    the sections it reads: [model] `mcfg`, [training] `tcfg` (seq_len) and [data] `dcfg` (its
    document masking); `build_args` takes the resolved length and masking."""
    # "auto" masking: resolved by the data (chat: block_causal)
    return build_args(mcfg, seq_len=tcfg.seq_len, masking=document_masking(mcfg, dcfg),
                      tokenizer_vocab_size=tokenizer_vocab_size)


def build_args(mcfg, *, seq_len: int, masking: tuple[str, bool],
               tokenizer_vocab_size: int | None = None):
    """The family's args from its [model] section `mcfg`: `seq_len` the RoPE table's length
    unless model.max_seq_len says, `masking` (attention mask type, restart positions per
    document) resolved for the run's data, `tokenizer_vocab_size` the vocab to cover."""
    spec = get(mcfg.name)
    if mcfg.flavor not in spec.flavors:
        raise ConfigError(
            f"model.flavor = {mcfg.flavor!r} is not a flavor of {mcfg.name}; "
            f"known: {', '.join(spec.flavors)}"
        )
    args = spec.flavors[mcfg.flavor]
    shape = shape_overrides(mcfg, spec)
    vocab = mcfg.vocab_size or tokenizer_vocab_size or args.vocab_size
    if tokenizer_vocab_size is not None and vocab < tokenizer_vocab_size:
        raise ConfigError(
            f"model.vocab_size = {vocab} is smaller than the tokenizer's vocab "
            f"({tokenizer_vocab_size}); unset it or make it >= {tokenizer_vocab_size}"
        )
    changes = {
        "vocab_size": padded_vocab_size(vocab, mcfg.vocab_pad_multiple, mcfg.vocab_pad_pow2),
        "max_seq_len": mcfg.max_seq_len or seq_len,
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


def check_family(saved_toml: str, name: str, where: str) -> None:
    """A checkpoint's weights load only into the family it was trained as: `name` (model.name of
    the saved config with the command's overrides) must be the one its `saved_toml` records."""
    from torchllm.config.loader import flat_toml

    saved = flat_toml(saved_toml).get("model.name", Model().name)
    if name != saved:
        raise ConfigError(
            f"model.name = {name!r}: {where} holds a {saved!r} model (its "
            f"config.toml), whose weights cannot load into a {name} one; drop "
            "--model.name (the checkpoint's config names its family)", "model.name")
