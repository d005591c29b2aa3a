"""Mutants of tools and benchmarks: memory estimate, model info, bench scripts (scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

MUTANTS = [
    Mutant.at(
        "bench_killed_rank_unnamed", "a benchmark variant whose rank was killed reports another "
        "rank's echo (a closed connection) instead of the killed rank and its signal",
        "benchmarks.benchlib.report:failure_reason",
        "    cause = root_cause(log)\n",
        "    cause = None\n",
        ("tests/test_bench.py::test_failure_reason_names_torchruns_root_cause_rank_and_how_it_"
         "ended",
         "tests/test_launch_path.py::test_the_benchmark_names_a_killed_rank_1_with_its_signal"),
    ),
    Mutant.at(
        "estimator_drops_attention_activations",
        "the memory estimator forgets the attention activations of every block",
        "torchllm.tools.activation_bytes:activation_bytes_per_block",
        "    return tokens * (attention + ffn) * act + stats",
        "    return tokens * ffn * act + stats",
        ("tests/test_estimate_memory.py::test_estimate_within_5_percent_of_measured_on_debug"
         "[activations]",),
    ),
    Mutant.at(
        "same_recipe_default_beta2", "the benchmark's 'same recipe' forgets nanoGPT's beta2 "
        "(torchllm's 0.95 instead of 0.99)",
        "benchmarks.bench_time_to_loss:same_recipe_args",
        "        f\"--optimizer.beta2={r['beta2']}\", ", "        ",
        ("tests/test_time_to_loss.py::test_same_recipe_is_the_reference_model_schedule_and_split",),
    ),
    Mutant.at(
        "model_info_table_without_shape", "model_info's table has no shape row",
        "torchllm.tools.model_info:info_table", "        f\"  shape            {info['shape']}\",\n", "",
        ("tests/test_model_shapes.py::test_model_info_table_and_json_show_the_shape",),
    ),
    Mutant.at(
        "estimate_ignores_loss_size_rule",
        "the memory estimator counts small bf16 logits as the chunked cross entropy's",
        "torchllm.tools.activation_bytes:loss_bytes",
        "    if act != FP32 and not plain_kernels(vocab_tokens):",
        "    if act != FP32:",
        ("tests/test_estimate_memory.py::test_estimate_within_5_percent_of_measured_on_debug",),
    ),
    Mutant.at(
        "bench_ratio_population_sd",
        "the throughput benchmark's interval uses the population standard deviation (too narrow)",
        "benchmarks.bench_throughput:paired_ratio",
        "    half = t * statistics.stdev(logs) / math.sqrt(len(logs))",
        "    half = t * statistics.pstdev(logs) / math.sqrt(len(logs))",
        ("tests/test_bench.py::test_throughput_ratio_is_paired_with_a_t_interval",),
    ),
    Mutant.at(
        "bench_ratio_arithmetic_mean",
        "the throughput benchmark's ratio is the arithmetic mean of the rounds' ratios, not "
        "their geometric mean",
        "benchmarks.bench_throughput:paired_ratio",
        "    return math.exp(mean), (math.exp(mean - half), math.exp(mean + half))",
        "    return statistics.fmean(ratios), (math.exp(mean - half), math.exp(mean + half))",
        ("tests/test_bench.py::test_throughput_ratio_is_paired_with_a_t_interval",),
    ),
    Mutant.at(
        "estimate_lora_frozen_grads",
        "the memory estimator gives LoRA's frozen weights gradients and optimizer state",
        "torchllm.tools.memory_phases:rank_memory",
        "    trained_named = [(n, p) for n, p in root_named + block_named if p.requires_grad]",
        "    trained_named = [(n, p) for n, p in root_named + block_named]",
        ("tests/test_lora.py::test_memory_estimate_counts_lora_as_the_benchmark_measures",),
    ),
    Mutant.at(
        "bench_gpu_peer_ratio_unpaired", "bench_gpu pairs each variant round with another round's peer run",
        "benchmarks.bench_gpu:run_shape",
        "                      for ours, peer in zip(runs[name], peer_runs)]",
        "                      for ours, peer in zip(runs[name], peer_runs[::-1])]",
        ("tests/test_gpu_harness.py::test_bench_gpu_cpu_path_reports_what_a_direct_run_measures",),
    ),
    Mutant.at(
        "bench_gpu_cpu_allows_float8", "bench_gpu on CPU starts a float8 variant (fails minutes later, unclearly)",
        "benchmarks.bench_gpu:parse_args",
        "        if cuda_only:\n            p.exit(2,",
        "        if False:\n            p.exit(2,",
        ("tests/test_gpu_harness.py::test_bench_gpu_on_cpu_refuses_cuda_only_options_in_one_line",),
    ),
    Mutant.at(
        "estimate_ignores_compile", "the estimate counts eager autocast's activations for compiled blocks",
        "torchllm.tools.memory_phases:rank_memory",
        '    compiled = ccfg.enable and "model" in ccfg.components and ac.mode == "none"',
        '    compiled = False',
        ("tests/test_estimate_memory_cuda.py::test_estimate_within_15_percent_of_the_h200_peaks",
         "tests/test_estimate_memory_cuda.py::test_compiled_and_float8_terms_count_what_the_partitioner_saves"),
    ),
    Mutant.at(
        "estimate_ignores_float8", "the estimate counts bf16 matmul inputs and weight copies under float8",
        "torchllm.tools.memory_phases:rank_memory",
        '    float8 = compiled and f8.enable and f8.recipe == "tensorwise"',
        '    float8 = False',
        ("tests/test_estimate_memory_cuda.py::test_estimate_within_15_percent_of_the_h200_peaks",
         "tests/test_estimate_memory_cuda.py::test_compiled_and_float8_terms_count_what_the_partitioner_saves"),
    ),
    Mutant.at(
        "sft_bench_oracle_drops_end_of_turn", "bench_sft_isolation scores a reply without its "
        "end-of-turn token (the trainer trains it)", "benchmarks.bench_sft_isolation:assistant_targets",
        "        if inside:\n            out.append(t)",
        "        if inside and i != end:\n            out.append(t)",
        ("tests/test_chat_isolation.py::"
         "test_the_sft_isolation_benchmarks_oracle_trains_what_the_trainer_trains",),
    ),
]
