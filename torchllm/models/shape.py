"""The shape keys families share, as fields for a family's own [model] dataclass
(models/<family>/config.py): each call returns a fresh `opt()` field, unset = the flavor's value.

A family takes the ones its args have (a key replaces the args field of its name) and may
declare new ones the same way; the loader accepts a family's keys when model.name selects it
(torchllm/config/components.py). A 4 x 128 GPT or a 20-layer Llama is then a TOML table.
"""

from __future__ import annotations

from torchllm.config.fields import POSITIVE, opt


def dim():
    return opt(None, "Override the flavor's model width (embedding dim)")


def n_layers():
    return opt(None, "Override the flavor's number of transformer blocks")


def n_heads():
    return opt(None, "Override the flavor's attention (query) heads")


def n_kv_heads():
    return opt(None, "Override the flavor's key/value heads (grouped-query attention)")


def head_dim():
    return opt(None, "Override the flavor's head width (a family without it: dim / n_heads)")


def hidden_dim():
    return opt(None, "Override the flavor's FFN (MLP / SwiGLU) width; dense layers, not MoE "
               "experts")


def ffn_dim_multiplier():
    return opt(None, "Scale Llama's derived SwiGLU width (2/3 x 4 x dim) by this, "
               "rounded up to a multiple of 256; replaces the flavor's explicit hidden width "
               "(set one of the two)", POSITIVE)
