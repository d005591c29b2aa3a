"""Mutants of the CPU tensor-memory measurement bench_memory compares the estimate with
(benchmarks/benchlib/tensor_memory.py) and of the estimate's terms that measurement corrected
(torchllm/tools/memory_phases.py); scripts/mutation_check.py runs them."""

from __future__ import annotations

from mutants.base import Mutant

BENCH = "tests/test_bench_memory.py::"

MUTANTS = [
    Mutant.at(
        "measure_frees_on_the_profiled_thread_only",
        "the CPU allocator's count moves only on the profiled thread again: a tensor freed on "
        "gloo's thread stays counted alive (ddp2, fsdp4, fsdp2-accum4 measured 0.62-0.85)",
        "benchmarks.benchlib.tensor_memory:count_every_thread",
        "        ctypes.c_bool.in_dll(lib, FLAG).value = True",
        "        ctypes.c_bool.in_dll(lib, FLAG).value = False",
        (BENCH + "test_a_free_on_another_thread_is_subtracted",),
    ),
    Mutant.at(
        "estimate_fsdp_embedding_kept_gathered",
        "the estimate keeps FSDP2's untied embedding gathered from forward to backward, though it "
        "is its own group, resharded after its forward (fsdp2 1.056)",
        "torchllm.tools.memory_phases:rank_memory",
        '                 and pcfg.fsdp_reshard_after_forward != "never")',
        "                 and False)",
        (BENCH + "test_estimate_within_10_percent_of_every_ranks_measured_peak",),
    ),
]
