"""Mutants of the suite's own scheduling (tests/conftest.py): xdist's workers are handed the
heaviest test files first (tests/suite/test_xdist_order.py; scripts/mutation_check.py runs
them)."""

from __future__ import annotations

from mutants.base import Mutant

ORDER = "tests/suite/test_xdist_order.py"

MUTANTS = [
    Mutant.at(
        "heavy_files_last", "the workers' files are sorted lightest first (a heavy file of one "
        "slow test starts last and runs alone at the end)",
        "tests.conftest:heavy_files_first",
        "key=lambda tests: -sum(", "key=lambda tests: sum(",
        (f"{ORDER}::test_heavy_files_start_first_each_file_whole_and_in_its_order",
         f"{ORDER}::test_only_xdist_workers_reorder_their_items"),
    ),
    Mutant.at(
        "xdist_resorts_files_by_test_count", "the controller keeps xdist's re-sorting of files "
        "by their number of tests, which undoes the workers' heavy-first order",
        "tests.conftest:pytest_configure",
        "config.option.loadscopereorder = False", "config.option.loadscopereorder = True",
        (f"{ORDER}::test_xdist_keeps_the_workers_order_on_the_controller_only",),
    ),
    Mutant.at(
        "slow_tests_weigh_as_quick_ones", "a slow test weighs as a quick one: files are "
        "ordered by their number of tests again",
        "tests.conftest:heavy_files_first",
        "SLOW_S if item.get_closest_marker(\"slow\") else QUICK_S", "QUICK_S",
        (f"{ORDER}::test_heavy_files_start_first_each_file_whole_and_in_its_order",),
    ),
]
