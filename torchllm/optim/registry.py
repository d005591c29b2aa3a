"""Optimizer registry: optimizer.name maps to its `OptimizerSpec` (torchllm/optim/spec.py).

The built-in optimizers register in torchllm/optim/__init__.py; one outside the package
registers itself in the module that `job.custom_import` names (imported when the config is
loaded). The trainer, the launcher's check and a resume only ever talk to the spec.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from torchllm.config import components
from torchllm.config.job_config import ConfigError
from torchllm.config.sections import Optimizer
from torchllm.optim.spec import OptimizerSpec

_REGISTRY: dict[str, OptimizerSpec] = {}


def register(spec: OptimizerSpec) -> None:
    """Add an optimizer; its keys must be [optimizer] keys (shared, or its own: spec.config),
    its hparams among its keys. The loader accepts its own keys where optimizer.name selects
    it."""
    fields = {f.name for f in dataclasses.fields(Optimizer)} - {"name"}
    fields |= {f.name for f in dataclasses.fields(spec.config)} if spec.config else set()
    unknown = [k for k in spec.keys if k not in fields]
    unknown += [f"{k} (an hparam not in its keys)" for k in spec.hparams if k not in spec.keys]
    if unknown:
        raise ValueError(f"optimizer {spec.name!r}: keys {unknown} are not [optimizer] keys it "
                         f"reads; known: {', '.join(sorted(fields))} (a new key is a field of "
                         "its own config dataclass, OptimizerSpec.config)")
    components.declare("optimizer", spec.name, Optimizer, spec.config)
    _REGISTRY[spec.name] = spec


def get(name: str) -> OptimizerSpec:
    if name not in _REGISTRY:
        raise ConfigError(f"optimizer.name = {name!r} is not registered; use one of "
                          f"{sorted(_REGISTRY)} (a module named by job.custom_import can "
                          "register more)", "optimizer.name")
    return _REGISTRY[name]


def build_optimizer(model: nn.Module, ocfg, device: torch.device) -> torch.optim.Optimizer:
    return get(ocfg.name).build(model, ocfg, device)


def resume_hparams(*names: str) -> set[str]:
    """The dotted [optimizer] keys a checkpoint of these optimizers (a saved config's and the
    current one's) carries in its param groups; names not registered here add none."""
    return {"optimizer." + k for n in names if n in _REGISTRY for k in _REGISTRY[n].hparams}
