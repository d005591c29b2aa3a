"""Which process this is: rank, world size, rank 0, a barrier — one home for the helpers every
layer uses, with or without a process group (a single process is rank 0 of 1).

`rank()` / `world_size()` ask the initialized process group (of `group`, default the world);
`env_rank()` / `env_world_size()` / `local_rank()` read what torchrun exported, for code that
runs before the group exists or after it is gone (a worker's status file, choosing the GPU).
"""

from __future__ import annotations

import os

import torch.distributed as dist


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group=None) -> int:
    return dist.get_rank(group) if initialized() else 0


def world_size(group=None) -> int:
    return dist.get_world_size(group) if initialized() else 1


def is_rank0() -> bool:
    return rank() == 0


def barrier() -> None:
    """Wait for every rank (a no-op without a process group)."""
    if initialized():
        dist.barrier()


def env_rank() -> int:
    """This process's global rank as torchrun exported it (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0"))


def env_world_size() -> int:
    """The number of processes torchrun started (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    """This process's rank on its node (its GPU index under torchrun; 0 outside it)."""
    return int(os.environ.get("LOCAL_RANK", "0"))
