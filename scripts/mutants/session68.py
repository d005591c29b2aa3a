"""Mutants of this round's lead-engineer fixes (suite speed, ft_local.sh relaunches)."""

from __future__ import annotations

from mutants.base import Mutant

MUTANTS = [
    Mutant.at(
        "compiled_block_forgets_the_norms_rstd",
        "the compiled block's saved activations leave out the two norms' float32 rstd",
        "torchllm.tools.activation_bytes:compiled_block_bytes",
        "                     + FP32 * (2 + args.n_heads))\n",
        "                     + FP32 * args.n_heads)\n",
        ("tests/test_estimate_memory_cuda.py::"
         "test_compiled_block_saves_what_compiled_block_bytes_counts",),
    ),
    Mutant(
        "ft_local_relaunch_truncates_the_log",
        "a relaunched group's ft_local.sh truncates the killed launch's log",
        "scripts/ft_local.sh",
        '    if [ -n "$relaunch" ]; then  # the killed launch',
        '    if false; then  # the killed launch',
        ("tests/test_fault_tolerance.py::"
         "test_a_killed_group_is_dropped_and_its_relaunch_heals_and_trains_in_step",),
    ),
    Mutant(
        "ft_local_stops_the_lighthouse_under_a_relaunch",
        "the launch that started the lighthouse stops it (and exits 137) while a relaunched group "
        "still trains",
        "scripts/ft_local.sh",
        '    if [ -n "$lighthouse_pid" ] && [ -f "$record.relaunch.$r" ]; then',
        '    if false; then',
        ("tests/test_fault_tolerance.py::"
         "test_a_killed_group_is_dropped_and_its_relaunch_heals_and_trains_in_step",),
    ),
]
