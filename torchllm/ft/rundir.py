"""Each replica group writes its own run folder: <run name>-replica<R>.

A group is a launch of its own (its lock, log, TensorBoard curves, checkpoints): the lowest live
group saves the periodic checkpoints into its folder, and a full restart resumes every group from
its own folder's newest checkpoint, after which the groups behind heal from the most advanced.
"""

from __future__ import annotations

import dataclasses

from torchllm.config import paths


def replica_run(cfg):
    """`cfg` with job.run_name naming this replica group's folder (unchanged when off)."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return cfg
    name = f"{paths.run_name(cfg.job)}-replica{ft.replica_id}"
    return dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, run_name=name))


def group_run(cfg) -> str:
    """The run a replica group belongs to: its folder's name (replica_run's) less `-replica<R>`."""
    name = paths.run_name(cfg.job)
    suffix = f"-replica{cfg.fault_tolerance.replica_id}"
    return name[:-len(suffix)] if cfg.fault_tolerance.enable and name.endswith(suffix) else name
