"""Mutants of issue 64's measure (scripts/config_coupling.py): the whole-config functions it
names as entry points, each with its reason, counted and shown apart from the others."""

from __future__ import annotations

from mutants.base import Mutant

T = "tests/test_config_coupling.py::"

MUTANTS = [
    Mutant.at(
        "entry_points_unmarked",
        "the measure looks entry points up under another path form (absolute, or the scanned "
        "folder's): none is marked, every whole-config function counts as coupling alike",
        "scripts.config_coupling:entry_point",
        '    return ENTRY_POINTS.get(f"{rel.as_posix()}:{name}")\n',
        '    return ENTRY_POINTS.get(f"{where.as_posix()}:{name}")\n',
        (T + "test_the_report_marks_entry_points_and_counts_them_apart",),
    ),
    Mutant.at(
        "entry_point_left_stale",
        "a named entry point outlives its function's refactor (it takes its sections now, or "
        "was renamed): the allow-list names code that no longer exists as named",
        "scripts.config_coupling:ENTRY_POINTS",
        '    "torchllm/eval/loss.py:evaluate_loss": ',
        '    "torchllm/eval/loss.py:evaluate_losses": ',
        (T + "test_every_named_entry_point_still_takes_the_whole_config",),
    ),
]
