"""Mutants of the memory estimate a user sizes a cluster by (torchllm/tools/estimate_memory.py,
memory_phases.py, dry_run.py) and of bench_memory (scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

CLI = "tests/test_estimate_memory_cli.py::"

MUTANTS = [
    Mutant.at(
        "estimate_tp_activations_undivided",
        "the estimate adds a block's activations before TP's division (the 70B FSDP32xTP8 3.3x)",
        "torchllm.tools.memory_phases:rank_memory",
        "        return per // tp  # sequence parallel and TP's head split: 1/tp of each",
        "        return per",
        (CLI + "test_tensor_parallel_divides_the_activations_in_every_phase",),
    ),
    Mutant.at(
        "estimate_optimizer_always_adamw",
        "the optimizer term is AdamW's 8 bytes per parameter for adamw8bit and muon too",
        "torchllm.tools.estimate_memory:estimate_memory",
        "    state_bytes = spec.state_bytes or adamw_state_bytes",
        "    state_bytes = adamw_state_bytes",
        (CLI + "test_optimizer_term_is_the_optimizers_own_state",),
    ),
    Mutant.at(
        "estimate_vocab_source_unsaid",
        "the estimate prints the vocabulary without saying it came from the auto-trained tokenizer",
        "torchllm.tools.estimate_memory:estimate_memory",
        "            vocab_source(cfg.model, cfg.data, model_args), ",
        '            f"{model_args.vocab_size:,}", ',
        (CLI + "test_assumptions_are_echoed_with_where_they_came_from",),
    ),
    Mutant.at(
        "estimate_peak_terms_do_not_add_up",
        "the terms shown for the peak are every term of the rank, not the peak phase's",
        "torchllm.tools.estimate_memory:estimate_memory",
        '        "peak_terms_bytes": worst["phases"][peak_phase],',
        '        "peak_terms_bytes": worst["terms_bytes"],',
        (CLI + "test_the_peak_phase_terms_add_up_in_the_json_and_the_table",),
    ),
    Mutant.at(
        "estimate_skips_the_trainers_checks",
        "the estimate checks the degrees only, so it estimates float8 + TP, which the trainer refuses",
        "torchllm.tools.estimate_memory:_checked",
        "    return build_parallel_dims(world_size, device, args,",
        "    return ParallelDims.from_config(parallelism, world_size) or build_parallel_dims(\n"
        "        world_size, device, args,",
        (CLI + "test_the_trainers_refusals_in_its_words",),
    ),
    Mutant.at(
        "verdict_without_reserved_margin",
        "--gpu_gib compares the allocated peak, not the reserved figure (no allocator margin)",
        "torchllm.tools.estimate_memory:verdict",
        '    fits = e["reserved_gib"] <= gpu_gib',
        '    fits = e["peak_gib"] <= gpu_gib',
        (CLI + "test_reserved_margin_decides_the_verdict_and_dry_run_names_only_levers_left",),
    ),
    Mutant.at(
        "dry_run_advises_ac_already_on",
        "dry_run advises activation checkpointing that is already fully on",
        "torchllm.tools.estimate_memory:levers",
        '    elif ac.mode == "selective":',
        '    else:',
        (CLI + "test_reserved_margin_decides_the_verdict_and_dry_run_names_only_levers_left",),
    ),
    Mutant.at(
        "estimate_fsdp_accumulation_unsharded",
        "under FSDP2 accumulation the estimate keeps unsharded gradients although the trainer "
        "reduce-scatters every micro-step",
        "torchllm.tools.memory_phases:rank_memory",
        '    every_step = getattr(pcfg, "fsdp_reduce_every_microstep", False)',
        "    every_step = False",
        (CLI + "test_fsdp_accumulation_keeps_sharded_gradients_unless_asked",),
    ),
    Mutant.at(
        "estimate_block_backward_upper_bound",
        "the blocks' backward counts every gradient beside every activation (the old upper "
        "bound: 1.2x the measured peak under selective AC)",
        "torchllm.tools.memory_phases:rank_memory",
        '            **state, "head_grads": head_grads, "activations": t["activations"],',
        '            **state, "head_grads": grads, "activations": t["activations"],',
        ("tests/test_bench_memory.py::test_estimate_within_10_percent_of_every_ranks_measured_peak",),
    ),
    Mutant.at(
        "bench_memory_estimates_the_worst_stage",
        "bench_memory compares every pipeline rank with the largest stage's estimate",
        "benchmarks.benchlib.worker:result",
        '    out["estimate_rank"] = out["estimate"]["ranks"][rank() // (world_size // pp)]',
        '    out["estimate_rank"] = out["estimate"]',
        ("tests/test_bench_memory.py::test_estimate_within_10_percent_of_every_ranks_measured_peak",),
    ),
]
