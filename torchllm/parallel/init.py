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

from torchllm.models.lora import init_weights


def has_sharded_params(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def init_model_weights(
    model: nn.Module,
    build_full: Callable[[], nn.Module],
    device: torch.device,
    seed: int,
    cpu_offload: bool = False,
) -> None:
    """`to_empty` + init, in place, drawing every random number from the seeded CPU generator
    and computing buffers (RoPE) on CPU, whatever `device` is: CUDA's generator would draw other
    numbers from the same seed. Unsharded models (single device, DDP) init on CPU and move;
    sharded ones receive rank 0's CPU init (see above)."""
    device = torch.device(device)
    sharded = has_sharded_params(model)
    if not sharded:
        model.to_empty(device="cpu")
        torch.manual_seed(seed)
        init_weights(model, buffer_device=torch.device("cpu"))  # (+ LoRA adapters)
        model.to(device)
        return
    model.to_empty(device="cpu" if cpu_offload else device)
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # CPU DTensors warn that their RNG is not sharding-aware
        warnings.filterwarnings("ignore", "DTensor random operators")
        init_weights(model, buffer_device=torch.device("cpu"))  # values replaced just below
    _move_buffers(model, device)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full_state = seeded_full_state(build_full, seed) if dist.get_rank() == 0 else {}
    set_model_state_dict(
        model, full_state,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )


def seeded_full_state(build_full: Callable[[], nn.Module], seed: int) -> dict:
    """The whole model's state dict as one CPU process initializes it with `seed`."""
    with torch.device("meta"):
        full = build_full()
    full.to_empty(device="cpu")
    torch.manual_seed(seed)
    init_weights(full, buffer_device=torch.device("cpu"))
    return full.state_dict()


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers (e.g. the RoPE table, computed on CPU) to the compute device, in place."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
