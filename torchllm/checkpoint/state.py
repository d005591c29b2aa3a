"""Adapters that give DCP one `state_dict()` / `load_state_dict()` per saved object.

Model and optimizer go through `torch.distributed.checkpoint.state_dict`, whose keys are plain
parameter names however the model is wrapped (DDP, FSDP2, TP): that is what makes a checkpoint
loadable under another parallelism or world size. Small Python objects (scheduler, data loader
position, counters, loss guard) are stored as one JSON text each (`JSONState`), so their
structure never has to match a template at load time, and reading them back builds numbers,
strings and containers only: a checkpoint is data. RNG states are DCP's own values (read with
torch.load(weights_only=True): index.DataPlanner).
"""

from __future__ import annotations

import json
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

from torchllm.checkpoint.index import CONVERT, STORED_DTYPES, UntrustedCheckpoint


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


class JSONState:
    """Any object with state_dict()/load_state_dict(), stored as one JSON text (`encode`)."""

    def __init__(self, obj):
        self.obj = obj

    def state_dict(self) -> dict:
        return {"json": json.dumps(encode(self.obj.state_dict()))}

    def load_state_dict(self, sd: dict) -> None:
        where = f"the saved state of {type(self.obj).__name__}"
        if "json" not in sd or not isinstance(sd["json"], str):
            raise UntrustedCheckpoint(
                f"{where} is not JSON (a pickle written by an older torchllm is never read); if "
                f"you trust the checkpoint, convert it once with: {CONVERT.format(path='STEP')}")
        try:
            value = decode(json.loads(sd["json"]))
        except (ValueError, TypeError, KeyError, RuntimeError) as e:  # RecursionError too
            raise ValueError(f"{where} cannot be read ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
        self.obj.load_state_dict(value)


# The values JSON has no form for, as {"__t": kind, "v": ...}; everything else is JSON's own.
_TAG = "__t"


def encode(value):
    """`value` (numbers, strings, bytes, containers, small tensors) as plain JSON values."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, tuple):
        return {_TAG: "tuple", "v": [encode(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {_TAG: "set", "v": [encode(v) for v in sorted(value, key=repr)]}
    if isinstance(value, (bytes, bytearray)):
        return {_TAG: "bytes", "v": bytes(value).hex()}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: encode(v) for k, v in value.items()}
        return {_TAG: "dict", "v": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        return {_TAG: "tensor", "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape), "v": t.flatten().tolist()}
    if isinstance(value, np.ndarray):
        return {_TAG: "ndarray", "dtype": value.dtype.str, "shape": list(value.shape),
                "v": value.flatten().tolist()}
    raise TypeError(f"a {type(value).__name__} cannot be saved as data (JSONState: numbers, "
                    "strings, bytes, lists, tuples, sets, dicts and tensors)")


def _dtype(name) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype) or value not in STORED_DTYPES:
        raise ValueError(f"{name!r} is not a torch dtype of plain numbers")
    return value


def decode(value):
    """The value `encode` wrote (builds numbers, strings, containers and tensors only)."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(_TAG)
    if kind is None:
        return {k: decode(v) for k, v in value.items()}
    v = value["v"]
    if kind == "tuple":
        return tuple(decode(x) for x in v)
    if kind == "set":
        return {decode(x) for x in v}
    if kind == "bytes":
        return bytes.fromhex(v)
    if kind == "dict":
        return {decode(k): decode(x) for k, x in v}
    if kind == "tensor":
        return torch.tensor(v, dtype=_dtype(value["dtype"])).reshape(value["shape"])
    if kind == "ndarray":
        dtype = np.dtype(str(value["dtype"]))
        if dtype.kind not in "biufc":
            raise ValueError(f"{value['dtype']!r} is not a NumPy dtype of plain numbers")
        return np.array(v, dtype=dtype).reshape(value["shape"])
    raise ValueError(f"unknown value kind {kind!r}")


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
