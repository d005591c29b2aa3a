"""Whether a step's saved tensors are this model family's: the fit check that runs last
(torchllm/checkpoint/resume/fit.py), once the other checks chose the states to read: the saved
keys and shapes against the model's (a hint a feature left, e.g. LoRA's other [lora] settings,
is the refusal instead), and no saved dtype of a kind its tensor cannot hold."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from torchllm.config.job_config import ConfigError


def family_fit(fit) -> None:
    """ConfigError when the states to read do not fit the step's saved keys, shapes or dtypes."""
    where, metadata, sds = fit.where, fit.step.metadata, fit.states
    mismatch = structure_mismatch(
        metadata, {k: sds[k] for k in ("model", "optimizer") if k in sds})
    if mismatch and fit.hints:
        raise ConfigError(*fit.hints[0])
    if mismatch:
        raise ConfigError(
            f"checkpoint {where} does not fit this model (saved shapes in "
            f"{where}/.metadata): {mismatch}; did model.name or model.flavor change?",
            "model.flavor")
    if kinds := dtype_mismatch(metadata, sds):
        raise ConfigError(f"checkpoint {where}/.metadata records {kinds}, which cannot "
                          "hold its values: the step is not this model's (replace it with "
                          "one from a trusted source)", "checkpoint")


def _flat_tensors(obj, prefix: str) -> dict[str, torch.Tensor]:
    """DCP's flattened names (dict keys joined by '.') of the tensors reachable through dicts."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flat_tensors(v, f"{prefix}.{k}"))
        return out
    return {}


def _kind(dtype: torch.dtype) -> str:
    return "complex" if dtype.is_complex else "floating-point" if dtype.is_floating_point \
        else "bool" if dtype == torch.bool else "integer"


def dtype_mismatch(metadata: Metadata, states: dict[str, dict]) -> str | None:
    """The first saved tensor whose dtype is of another kind (complex, floating-point,
    integer, bool) than the tensor it would load into: a complex64 weight for a float32
    parameter would lose its imaginary part, a float for an integer its fraction."""
    saved = metadata.state_dict_metadata
    for name, t in (kv for key, sd in states.items() for kv in _flat_tensors(sd, key).items()):
        md = saved.get(name)
        if isinstance(md, TensorStorageMetadata) and type(t) in (torch.Tensor, torch.nn.Parameter,
                                                                 DTensor):
            was, now = md.properties.dtype, t.dtype
            if _kind(was) != _kind(now) and not (_kind(now) == "floating-point"
                                                 and _kind(was) in ("integer", "bool")):
                return f"{name} as {str(was).removeprefix('torch.')} ({_kind(was)}), for a " \
                       f"{str(now).removeprefix('torch.')} tensor"
    return None


def structure_mismatch(metadata: Metadata, states: dict[str, dict], limit: int = 4) -> str | None:
    """What keeps `states` (top-level key -> state dict about to be loaded) from matching the
    checkpoint: missing keys, unexpected model keys, and saved vs expected shapes."""
    saved = metadata.state_dict_metadata
    # Plain tensors and DTensors only: quantized subclasses (8-bit optimizer moments) are laid
    # out by their own flattening, which DCP checks itself.
    expected = {k: v for key, sd in states.items() for k, v in _flat_tensors(sd, key).items()
                if type(v) in (torch.Tensor, torch.nn.Parameter, DTensor)}
    missing, shapes = [], []
    for name, t in expected.items():
        md = saved.get(name)
        if md is None:
            missing.append(name)
        elif isinstance(md, TensorStorageMetadata) and tuple(md.size) != tuple(t.shape):
            shapes.append(f"{name} saved {list(md.size)} vs expected {list(t.shape)}")
    unexpected = []
    if "model" in states:
        unexpected = [k for k in saved if k.startswith("model.") and k not in expected]
    parts = []
    for what, items in (("shape mismatch", shapes), ("missing", missing),
                        ("unexpected", unexpected)):
        if items:
            more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
            parts.append(f"{what}: {', '.join(items[:limit])}{more}")
    return "; ".join(parts) or None
