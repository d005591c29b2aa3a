"""Mutants of fault tolerance with DDP inside a replica group (issue 65 #7, #4: the fixed
buckets of apply_ddp / ParallelPlan.static_ddp_buckets, the overlapped DDP comm hook of
torchllm/ft/overlap.py; scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

T = "tests/test_ft_ddp_heal.py::"
HEAL = T + "test_a_killed_ddp_group_of_two_ranks_heals_to_its_peers_weights_and_optimizer"
BUCKETS = T + "test_a_relaunched_ddp_groups_buckets_are_its_peers_from_its_first_step"

MUTANTS = [
    Mutant.at(
        "ft_ddp_buckets_rebuilt", "DDP's buckets are rebuilt after the first iteration under "
        "fault tolerance: a relaunched group's first step reduces one bucket of every gradient "
        "while its peers reduce their rebuilt ones (the cross-group all-reduces do not pair)",
        "torchllm.parallel.data_parallel:apply_ddp",
        '{"find_unused_parameters": True} if static_buckets',
        '{"find_unused_parameters": False} if static_buckets', (BUCKETS, HEAL)),
    Mutant.at(
        "ft_ddp_buckets_not_fixed_under_ft", "the model's plan does not fix DDP's buckets when "
        "fault tolerance is on: a relaunched group's first step reduces other buckets than its "
        "peers' (gloo aborts the survivor)",
        "torchllm.parallel.plan:ParallelPlan.of", "and fault_tolerance.enable))",
        "and False))", (HEAL,)),
    Mutant.at(
        "ft_ddp_comm_hook_not_installed", "DDP groups of two ranks get no overlapped comm hook: "
        "their gradients cross groups after backward, serialized",
        "torchllm.ft.overlap:OverlappedMean.install",
        'dims.ddp_enabled and ddp_comm_hook == "none"',
        'dims.ddp_enabled and ddp_comm_hook == "never"', (HEAL,)),
]
