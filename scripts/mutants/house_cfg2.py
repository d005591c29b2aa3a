"""Mutants of issue 64's "components own their config" (second pass) and its test layout:
the loop hands the train module the plan the model was built with, ParallelPlan.of reads
fault tolerance's static DDP buckets, the estimate's checks keep float8's emulation for a GPU
target off-GPU, and scripts/test_layout.py --check names a row whose module is gone."""

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
]
