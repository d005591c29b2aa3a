"""Each replica group writes its own run folder: <run name>-replica<R>.

A group is a launch of its own (its lock, log, TensorBoard curves, checkpoints): the lowest live
group saves the periodic checkpoints into its folder, and a full restart resumes every group from
its own folder's newest checkpoint, after which the groups behind heal from the most advanced.
"""

from __future__ import annotations

import dataclasses

from torchllm.config import paths


def replica_job(job, ftcfg):
    """The [job] section `job` with run_name naming this replica group's folder (unchanged
    when [fault_tolerance] `ftcfg` is off)."""
    if not ftcfg.enable:
        return job
    return dataclasses.replace(job, run_name=f"{paths.run_name(job)}-replica{ftcfg.replica_id}")


def group_run(job, ftcfg) -> str:
    """The run a replica group belongs to: its folder's name (replica_job's) less `-replica<R>`."""
    name = paths.run_name(job)
    suffix = f"-replica{ftcfg.replica_id}"
    return name[:-len(suffix)] if ftcfg.enable and name.endswith(suffix) else name
