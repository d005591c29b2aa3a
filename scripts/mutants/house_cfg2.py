"""Mutants of issue 64's "components own their config" (second pass) and its test layout:
ParallelPlan.of, the one constructor from a run's sections, reads fault tolerance's static DDP
buckets; scripts/test_layout.py --check names a LAYOUT row whose module is gone."""

from __future__ import annotations

from mutants.base import Mutant

LAYOUT = "tests/suite/test_tests_layout.py::"

MUTANTS = [
    Mutant.at(
        "layout_check_ignores_a_stale_row",
        "a test module removed or renamed leaves its LAYOUT row behind and --check stays green",
        "scripts.test_layout:problems",
        "for name in sorted(set(layout) - set(seen)):",
        "for name in sorted(set(layout) - set(layout)):",
        (LAYOUT + "test_check_names_a_row_whose_module_is_gone",),
    ),
    Mutant.at(
        "plan_of_ignores_fault_tolerance",
        "the plan built from a run's sections drops [fault_tolerance]: a relaunched replica "
        "group's DDP rebuilds its buckets in another order than its peers'",
        "torchllm.parallel.plan:ParallelPlan.of",
        "static_ddp_buckets=bool(fault_tolerance is not None",
        "static_ddp_buckets=bool(fault_tolerance is None",
        ("tests/unit/parallel/test_parallel.py::"
         "test_the_plan_of_a_runs_sections_keeps_ddp_buckets_static_under_fault_tolerance",),
    ),
]
