"""The [fault_tolerance] section: replica groups that keep training when one dies (torchft).

Kept apart from sections.py (one table, its checks beside it). The lighthouse's address is not a
key: torchft reads it from TORCHFT_LIGHTHOUSE (default: the run's own port, ft/lighthouse.py), a
launcher variable like NGPU (docs/fault_tolerance.md).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Literal

from torchllm.config.fields import BELOW_ONE, POSITIVE, opt


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
    bind: str = opt(
        "127.0.0.1", "The address a group's heal server listens on (and scripts/ft_local.sh's "
        "lighthouse): loopback for groups on one machine; an interface's IP address (or 0.0.0.0, "
        "every interface) for groups on several"
    )
    secret_env: str = opt(
        "TORCHLLM_FT_SECRET", "The environment variable holding the run's shared secret (at least "
        "16 characters, the same in every group): a heal is served only to a peer that proves it "
        "has it, and loaded only from one (scripts/ft_local.sh makes one per run)"
    )
    secret_file: str = opt(
        "", "A file holding the run's shared secret instead of secret_env (readable by its owner "
        "only)"
    )
    process_group: Literal["gloo", "nccl"] = opt(
        "gloo", "The backend of the all-reduce across replica groups (torchft's reconfigurable "
        "process group): gloo (CPU, or GPUs through host memory) or nccl (GPU to GPU: the groups "
        "must train on CUDA)"
    )
    overlap: bool = opt(
        True, "Average the gradients across groups inside the group's own reduction, unit by "
        "unit as backward produces them (FSDP2's all-reduce hook, a DDP comm hook), instead of "
        "over all of them after backward (always so for a group of one rank); same numbers"
    )
    semi_sync_method: Literal["none", "diloco", "local_sgd"] = opt(
        "none", "How the groups stay together: none = gradients averaged every step; diloco = "
        "each group trains sync_steps steps alone, then the groups average their parameter "
        "change and apply it with the outer optimizer (outer_lr, outer_momentum, "
        "outer_nesterov); local_sgd = the same, the groups' parameters plainly averaged "
        "(checkpoints at sync points only; docs/fault_tolerance.md)"
    )
    sync_steps: int = opt(
        5, "semi_sync_method diloco / local_sgd: steps each group trains alone between syncs "
        "(DiLoCo's H); checkpoint.interval must be a multiple of it"
    )
    num_fragments: int = opt(
        1, "semi_sync_method diloco / local_sgd: streaming DiLoCo, the model's blocks in this "
        "many contiguous fragments, fragment f synced after sync_steps x (f + 1) / "
        "num_fragments steps of each interval (each sync sends ~1/num_fragments of the "
        "parameters; all at the last step and at checkpoint steps); 1 = all at once"
    )
    outer_lr: float = opt(0.7, "DiLoCo's outer optimizer (SGD): its learning rate", POSITIVE)
    outer_momentum: float = opt(0.9, "DiLoCo's outer optimizer: its momentum (0 = none)",
                                BELOW_ONE)
    outer_nesterov: bool = opt(True, "DiLoCo's outer optimizer: Nesterov momentum")


NCCL_ON_CPU = ("fault_tolerance.process_group = 'nccl' needs CUDA, but {where}: use "
               "fault_tolerance.process_group = 'gloo' (works on CPU and GPU), or train on CUDA")


def fault_tolerance_errors(ft: FaultTolerance, checkpoint, device: str,
                           pipeline_degree: int) -> list[tuple[str, str]]:
    """(key, message) for every value-only problem of [fault_tolerance] `ft` (off: none), with
    what it constrains elsewhere: the [checkpoint] section, training.device and
    parallelism.pipeline_parallel_degree."""
    if not ft.enable:
        if ft.semi_sync_method != "none":
            return [("fault_tolerance.semi_sync_method", "fault_tolerance.semi_sync_method = "
                     f"{ft.semi_sync_method!r} syncs replica groups, and fault_tolerance.enable "
                     "is false: set --fault_tolerance.enable (one launch per group; "
                     "scripts/ft_local.sh), or semi_sync_method = 'none'")]
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
    try:
        ipaddress.ip_address(ft.bind)
    except ValueError:
        return [("fault_tolerance.bind", f"fault_tolerance.bind = {ft.bind!r} is not an IP "
                 "address: use 127.0.0.1 (one machine), an interface's address, or 0.0.0.0")]
    if not ft.secret_env.isidentifier():
        return [("fault_tolerance.secret_env", f"fault_tolerance.secret_env = {ft.secret_env!r} "
                 "is not an environment variable's name (e.g. TORCHLLM_FT_SECRET)")]
    if ft.process_group == "nccl" and device == "cpu":
        return [("fault_tolerance.process_group", NCCL_ON_CPU.format(where="training.device = "
                                                                     "'cpu'"))]
    pp = pipeline_degree
    if pp > 1:
        return [("fault_tolerance.enable", "fault_tolerance.enable with "
                 f"parallelism.pipeline_parallel_degree = {pp} is not supported: torchft replicates "
                 "whole groups over the data-parallel dimension and heals a group from one peer "
                 "rank per rank, which a pipeline's stages do not line up with; use "
                 "pipeline_parallel_degree = 1 (DDP, FSDP2, TP or CP inside each group)")]
    return semi_sync_errors(ft, checkpoint)


def semi_sync_errors(ft: FaultTolerance, ckpt) -> list[tuple[str, str]]:
    """(key, message) for semi-synchronous training's settings (method 'none': none), with
    the [checkpoint] section `ckpt` they constrain."""
    if ft.semi_sync_method == "none":
        return []
    if ft.sync_steps < 1:
        return [("fault_tolerance.sync_steps", f"fault_tolerance.sync_steps = {ft.sync_steps}: "
                 "must be >= 1 (the steps each group trains alone between syncs)")]
    if ft.num_fragments < 1 or ft.sync_steps % ft.num_fragments:
        return [("fault_tolerance.num_fragments", "fault_tolerance.num_fragments = "
                 f"{ft.num_fragments} with fault_tolerance.sync_steps = {ft.sync_steps}: each "
                 "fragment syncs at its own step of the interval, so num_fragments must be >= 1 "
                 "and divide sync_steps (e.g. num_fragments = 2 with sync_steps = 10)")]
    if ckpt.enable and ckpt.interval % ft.sync_steps:
        return [("checkpoint.interval", f"checkpoint.interval = {ckpt.interval} is not a "
                 f"multiple of fault_tolerance.sync_steps = {ft.sync_steps}: between syncs the "
                 "groups' weights differ, so checkpoints are taken at sync points only; use "
                 f"checkpoint.interval = {max(1, ckpt.interval // ft.sync_steps) * ft.sync_steps}"
                 " (or another multiple of sync_steps)")]
    if ft.semi_sync_method == "diloco" and ft.outer_nesterov and ft.outer_momentum == 0:
        return [("fault_tolerance.outer_nesterov", "fault_tolerance.outer_nesterov = true with "
                 "fault_tolerance.outer_momentum = 0: Nesterov needs a momentum; set "
                 "outer_momentum (DiLoCo: 0.9) or outer_nesterov = false")]
    return []
