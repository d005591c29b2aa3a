"""Mutants of the tests' layout (issue 64, "tests laid out like the package"):
scripts/test_layout.py places test modules by its table and refuses an unknown one before moving any, and
scripts/mutation_check.py resolves a mutant's test id whose file moved by its unique basename."""

from __future__ import annotations

from mutants.base import Mutant

LAYOUT = "tests/suite/test_tests_layout.py::"
CHECK = "tests/suite/test_mutation_check.py::"

MUTANTS = [
    Mutant.at(
        "layout_unknown_file_moves_the_rest",
        "a test module no row names is reported, but the known ones are moved anyway",
        "scripts.test_layout:main",
        "    if errors:\n",
        "    if errors and not planned:\n",
        (LAYOUT
         + "test_a_new_flat_module_is_placed_by_its_row_and_an_unknown_one_stops_every_move",),
    ),
    Mutant.at(
        "mutant_test_id_twin_basename_picks_one",
        "a moved test id whose basename is at two places under tests/ silently runs the first",
        "scripts.mutation_check:resolve",
        "if len(found) == 1 else test",
        "if found else test",
        (CHECK + "test_a_test_id_whose_file_moved_resolves_by_its_basename",),
    ),
]
