"""Materialize a (possibly sharded) model with the same initial weights as one device.

Random init of a sharded parameter draws different numbers than init of the whole tensor (and
CPU DTensors have no sharding-aware RNG), so a sharded run would start from other weights than
a single-process run with the same seed. Instead, rank 0 builds the full model on CPU, seeds and
initializes it exactly as a single CPU process does, and `set_model_state_dict` broadcasts it
and keeps each rank's shard: one full copy in rank 0's CPU memory, for the duration of init.
For models too large for that, a seed checkpoint (written once, loaded sharded) is the way.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def has_sharded_params(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def init_model_weights(
    model: nn.Module,
    build_full: Callable[[], nn.Module],
    device: torch.device,
    seed: int,
    cpu_offload: bool = False,
) -> None:
    """`to_empty` + init, in place. Unsharded models (single device, DDP) init directly:
    every rank draws the same numbers from the same seed (and DDP broadcasts rank 0's anyway)."""
    model.to_empty(device="cpu" if cpu_offload else device)
    torch.manual_seed(seed)
    sharded = has_sharded_params(model)
    with warnings.catch_warnings():
        if sharded:  # CPU DTensors warn that their RNG is not sharding-aware: see above
            warnings.filterwarnings("ignore", "DTensor random operators")
        model.init_weights(buffer_device=device)  # also the non-persistent buffers (RoPE)
    if not sharded:
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full_state = {}
    if dist.get_rank() == 0:
        with torch.device("meta"):
            full = build_full()
        full.to_empty(device="cpu")
        torch.manual_seed(seed)
        full.init_weights(buffer_device=torch.device("cpu"))
        full_state = full.state_dict()
    set_model_state_dict(
        model, full_state,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
