"""Fault tolerance: replica groups that keep training when one dies (torchft; docs/fault_tolerance.md).

Each replica group is one launch (`./run_train.sh --fault_tolerance.enable ...`, or all of them
through scripts/ft_local.sh); torchft's lighthouse decides each step which groups train it.
"""

from torchllm.ft.heal import HealState
from torchllm.ft.lighthouse import check_fault_tolerance
from torchllm.ft.build import build_replicas
from torchllm.ft.replicas import ReplicaGroups, ReplicasBelowMinimum, SingleGroup
from torchllm.ft.rundir import replica_job

__all__ = ["HealState", "ReplicaGroups", "ReplicasBelowMinimum", "SingleGroup", "build_replicas",
           "check_fault_tolerance", "replica_job"]
