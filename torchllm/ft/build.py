"""The run's replica groups, as fault_tolerance asks: none, step-synchronous (replicas.py) or
semi-synchronous (semi_sync.py)."""

from __future__ import annotations

import os

import torch.distributed as dist

from torchllm.ft.lighthouse import check_fault_tolerance, lighthouse_address
from torchllm.ft.replicas import ReplicaGroups, SingleGroup
from torchllm.ft.rundir import group_run
from torchllm.ft.semi_sync import SemiSyncGroups


def build_replicas(ftcfg, job, device: str, group_batch: int) -> SingleGroup:
    """The run's replica groups ([fault_tolerance] `ftcfg`, of the run [job] names, training on
    training.device `device`): a no-op SingleGroup unless fault_tolerance.enable."""
    if not ftcfg.enable:
        return SingleGroup()
    run = group_run(job, ftcfg)  # ([job] names this group's folder, <run>-replica<R>)
    check_fault_tolerance(ftcfg, job, device, os.environ, run)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    groups = ReplicaGroups if ftcfg.semi_sync_method == "none" else SemiSyncGroups
    return groups(ftcfg, rank, world, group_batch, run,
                  lighthouse_address(os.environ, run, job.dump_folder, ftcfg.bind))
