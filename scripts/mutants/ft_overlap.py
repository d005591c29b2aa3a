"""Mutants of the cross-group gradient mean inside FSDP2's / DDP's reduction (issue 65 #4, #7:
torchllm/ft/overlap.py, its step gate in ft/replicas.py) and of the fault-tolerance benchmark's
per-step cost (scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

T = "tests/test_ft_overlap.py::"
EQUAL = T + "test_the_mean_across_groups_inside_the_groups_reduction_equals_the_after_backward_one"
HEAL = ("tests/test_ft_fsdp_heal.py::"
        "test_a_killed_fsdp2_group_of_two_ranks_heals_to_its_peers_weights_and_optimizer")
REFUSED = T + "test_groups_that_average_in_different_places_refuse_each_other_naming_the_key"
BENCH = T + "test_the_benchmark_reports_fault_tolerances_per_step_cost_at_the_tiniest_shape"

MUTANTS = [
    Mutant.at(
        "ft_overlap_hook_idle", "the reduction hooks never average across groups (and the "
        "after-backward path leaves the hooked gradients to them): each group keeps its own",
        "torchllm.ft.overlap:OverlappedMean.mean", "        if self.active:\n",
        "        if not self.active:\n", (EQUAL + "[fsdp]", EQUAL + "[ddp]")),
    Mutant.at(
        "ft_overlap_ddp_sums_the_group", "the DDP comm hook sums the group's ranks' gradients "
        "instead of averaging them (DDP's own reduction divides by the group's size)",
        "torchllm.ft.overlap:ddp_mean_hook", "    buf.div_(dist.get_world_size(group))\n",
        "", (EQUAL + "[ddp]",)),
    Mutant.at(
        "ft_overlap_never_in_a_step", "the hooks are never switched on for a step: FSDP2 groups "
        "of two ranks train on their own gradients and drift apart",
        "torchllm.ft.replicas:ReplicaGroups.begin_step", "self.overlap.active = True",
        "self.overlap.active = False", (HEAL,)),
    Mutant.at(
        "ft_overlap_not_compared", "groups with and without the overlapped mean are not refused "
        "(their all-reduces do not line up: gloo aborts or hangs)",
        "torchllm.ft.identity:group_record", '"overlap", "semi_sync_method"',
        '"semi_sync_method"', (REFUSED,)),
    Mutant.at(
        "ft_bench_cost_not_against_plain", "the benchmark's per-step cost is the step time "
        "with torchft, not its difference from the same run without it",
        "benchmarks.bench_fault_tolerance:step_cost",
        "round(out[name] - base, 1)", "round(out[name], 1)", (BENCH,)),
]
