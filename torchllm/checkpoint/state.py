"""Adapters that give DCP one `state_dict()` / `load_state_dict()` per saved object.

Model and optimizer go through `torch.distributed.checkpoint.state_dict`, whose keys are plain
parameter names however the model is wrapped (DDP, FSDP2, TP): that is what makes a checkpoint
loadable under another parallelism or world size. Small Python objects (scheduler, data loader
position, counters, RNG states) are pickled into one bytes value each, so their structure never
has to match a template at load time; they are read back by an unpickler that builds plain
containers of numbers and strings only (safe_load.load_state_pickle: checkpoints are data).
"""

from __future__ import annotations

import pickle
import random
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchllm.checkpoint.safe_load import load_state_pickle


class ModelState:
    """The model's parameters (and persistent buffers), optionally cast for export."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None):
        self.model, self.dtype = model, dtype

    def state_dict(self) -> dict:
        sd = get_model_state_dict(self.model)
        if self.dtype is not None:
            sd = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in sd.items()}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        set_model_state_dict(self.model, sd, options=StateDictOptions(strict=True))


class OptimizerState:
    """Optimizer state keyed by parameter names (not ids), so it reshards like the model.

    An `OptimizerList` (Muon + AdamW) is passed as its list of optimizers, which
    torch.distributed.checkpoint merges into one state dict keyed by parameter names.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = getattr(optimizer, "optimizers", optimizer)

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, sd: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, sd)


class PickledState:
    """Any object with state_dict()/load_state_dict(), stored as one pickled value."""

    def __init__(self, obj):
        self.obj = obj

    def state_dict(self) -> dict:
        return {"pickle": pickle.dumps(self.obj.state_dict())}

    def load_state_dict(self, sd: dict) -> None:
        where = f"the saved state of {type(self.obj).__name__} (a checkpoint's *.pickle value)"
        self.obj.load_state_dict(load_state_pickle(sd["pickle"], where))


class RNGState:
    """Python, NumPy, torch CPU and this rank's own CUDA generator states.

    Only the current device's generator: every rank owns one GPU, and saving all visible ones
    (get_rng_state_all) would initialize a context on every GPU and restore other ranks'
    generators from this rank's copy.
    """

    def state_dict(self) -> dict:
        state = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()  # the current device's
        return state

    def load_state_dict(self, state: dict) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        cuda = state.get("cuda")
        if cuda is not None and torch.cuda.is_available():
            if isinstance(cuda, (list, tuple)):  # older checkpoints: every visible GPU's
                index = torch.cuda.current_device()
                if index >= len(cuda):
                    return
                cuda = cuda[index]
            torch.cuda.set_rng_state(cuda)


@dataclass
class TrainState:
    """Counters that continue across a resume."""

    step: int = 0
    tokens_seen: int = 0
    best_val_loss: float = float("inf")

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, sd: dict) -> None:
        for key, value in sd.items():
            setattr(self, key, value)
