"""Mutants of this round's lead-engineer work (the side-by-side revision benchmark)."""

from __future__ import annotations

from mutants.base import Mutant

REVISIONS = ("tests/test_bench_revisions.py::"
             "test_both_trees_run_their_own_code_and_the_ratio_is_after_over_before",)

MUTANTS = [
    Mutant(
        "bench_revisions_runs_this_tree_twice",
        "bench_revisions starts every process in this checkout, so 'before' times this code",
        "benchmarks/bench_revisions.py",
        '    return {"cwd": tree,',
        '    return {"cwd": REPO,',
        REVISIONS,
    ),
    Mutant(
        "bench_revisions_ratio_inverted",
        "bench_revisions reports before / after as after / before",
        "benchmarks/bench_revisions.py",
        '        row["step_ratio"] = round(row["after_step_ms"] / row["before_step_ms"], 3)',
        '        row["step_ratio"] = round(row["before_step_ms"] / row["after_step_ms"], 3)',
        REVISIONS,
    ),
]

MUTANTS.append(
    Mutant.at(
        "semi_sync_quorum_says_effective_global_batch",
        "semi-synchronous groups' quorum line says an effective global batch, as if every step "
        "averaged the groups' gradients",
        "torchllm.ft.semi_sync:SemiSyncGroups.batch_note",
        '        return (f"each group trains its own',
        '        return super().batch_note(live) or (f"each group trains its own',
        ("tests/test_ft_semi_sync.py::"
         "test_two_diloco_groups_through_ft_local_end_with_equal_weights",),
    ))

MUTANTS.append(
    Mutant.at(
        "estimate_table_reads_the_whole_config",
        "a builder reads a section through the whole JobConfig again (the estimate's table)",
        "torchllm.tools.estimate_memory:estimate_table",
        "        f\"{mcfg.name}/{mcfg.flavor} on",
        "        f\"{mcfg.model.name}/{mcfg.flavor} on",
        ("tests/suite/test_config_coupling.py::"
         "test_only_the_named_entry_points_take_the_whole_config",),
    ))

MUTANTS.append(
    Mutant.at(
        "semi_sync_relaunch_keeps_its_own_anchor",
        "a relaunched DiLoCo group heals the weights but keeps its own parameters-at-the-last-sync "
        "(its fresh initial weights): its next sync's change is not the survivor's",
        "torchllm.ft.semi_sync:OuterStep.load_state_dict",
        "        for a, theirs in zip(self.anchor, anchor):",
        "        for a, theirs in zip(self.anchor, []):",
        ("tests/integration/test_ft_semi_sync_heal.py::"
         "test_a_killed_diloco_group_rejoins_at_a_sync_point_and_ends_with_its_peers_state",),
    ))
