"""The [fault_tolerance] section: replica groups that keep training when one dies (torchft).

Kept apart from sections.py (one table, its checks beside it). The lighthouse's address is not a
key: torchft reads it from TORCHFT_LIGHTHOUSE (default: the run's own port, ft/lighthouse.py), a
launcher variable like NGPU (docs/fault_tolerance.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchllm.config.fields import opt


@dataclass
class FaultTolerance:
    enable: bool = opt(
        False, "Train as one replica group of several (torchft): gradients are averaged over the "
        "live groups each step; a group that dies is dropped, a relaunched one heals from a live "
        "peer (docs/fault_tolerance.md; scripts/ft_local.sh starts a lighthouse and N groups)"
    )
    replica_id: int = opt(0, "This launch's replica group: 0 .. group_size - 1")
    group_size: int = opt(
        1, "How many replica groups the run has at most: each reads its own 1/group_size of the "
        "data (by replica_id), the effective global batch is the live groups' batches together"
    )
    min_replica_size: int = opt(
        1, "Fewest live replica groups that may train a step: below it the groups save (the "
        "lowest live one) and stop cleanly (exit 0); 1 .. group_size"
    )


def fault_tolerance_errors(cfg) -> list[tuple[str, str]]:
    """(key, message) for every value-only problem of [fault_tolerance] (off: none)."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return []
    if ft.group_size < 1:
        return [("fault_tolerance.group_size", f"fault_tolerance.group_size = {ft.group_size}: "
                 "must be >= 1 (the number of replica groups)")]
    if not 0 <= ft.replica_id < ft.group_size:
        return [("fault_tolerance.replica_id", f"fault_tolerance.replica_id = {ft.replica_id} is "
                 f"outside group_size = {ft.group_size}: use 0 .. {ft.group_size - 1}, or raise "
                 "fault_tolerance.group_size")]
    if not 1 <= ft.min_replica_size <= ft.group_size:
        return [("fault_tolerance.min_replica_size", "fault_tolerance.min_replica_size = "
                 f"{ft.min_replica_size}: must be 1 .. group_size ({ft.group_size})")]
    pp = cfg.parallelism.pipeline_parallel_degree
    if pp > 1:
        return [("fault_tolerance.enable", "fault_tolerance.enable with "
                 f"parallelism.pipeline_parallel_degree = {pp} is not supported: torchft replicates "
                 "whole groups over the data-parallel dimension and heals a group from one peer "
                 "rank per rank, which a pipeline's stages do not line up with; use "
                 "pipeline_parallel_degree = 1 (DDP, FSDP2, TP or CP inside each group)")]
    return []
