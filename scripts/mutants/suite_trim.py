"""Mutants of what the suite-time work moved: parallelism.md's NGPU=2 FSDP2 line, checked in the
docs test (tests/test_docs_commands.py PRINTS) instead of a second launch of the same command
(scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

MUTANTS = [
    Mutant.at(
        "batch_line_dp_degree_one", "the run header's batch line counts 1 data-parallel rank "
        "whatever the layout (2 FSDP2 ranks print '2 local x 1 dp')",
        "torchllm.metrics.header:context_header",
        'f"{tcfg.local_batch_size} local x {dims.dp_degree} dp x "',
        'f"{tcfg.local_batch_size} local x 1 dp x "',
        ("tests/test_docs_commands.py::test_documented_commands_run[parallelism.md]",),
    ),
]
