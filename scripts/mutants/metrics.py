"""Mutants of metrics, guards, the run report (scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

MUTANTS = [
    Mutant.at(
        "partial_norm_local", "a Partial DTensor's norm is taken of this rank's pending share",
        "torchllm.metrics.norms:_local_square", "            t = t.full_tensor()\n",
        "            t = t.to_local()\n",
        ("tests/test_metrics_dist.py::test_reductions_norms_and_per_rank_folders_over_two_ranks",),
    ),
    Mutant.at(
        "report_loss_against_steps", "the report's loss plot ignores the tokens seen",
        "torchllm.report.plots:draw",
        "                x = run.tokens_at(series.steps) if by_tokens else series.steps\n",
        "                x = series.steps\n",
        ("tests/test_report.py::test_the_run_writes_a_report_whose_plots_are_the_events_values",),
    ),
    Mutant.at(
        "header_validation_when_off", "the header names the validation split when validation is off",
        "torchllm.metrics.header:data_summary",
        "    held_out = (val_dataset.describe() if validation else",
        "    held_out = (val_dataset.describe() if True else",
        ("tests/test_header_fixes.py::test_validation_is_named_only_when_it_is_on",),
    ),
    Mutant.at(
        "end_block_prompt_for_chat_runs", "a chat run's end-of-run block suggests --prompt",
        "torchllm.report.hook:RunReport.end_block", "            ask = ('--chat \"Hi! How are you?\"' if "
        "reads_conversations(cfg.data)\n", "            ask = ('--chat \"Hi! How are you?\"' "
        "if False\n",
        ("tests/test_data_kinds.py::test_run_train_sh_trains_the_shipped_sft_config",),
    ),
    Mutant.at(
        "cpu_peak_raised_to_fit", "the CPU peak is raised to what a step reached (MFU ~100% by construction)",
        "torchllm.metrics.flops:CPUPeak.check",
        "        if achieved > self.flops and not self.warned:",
        "        self.flops = max(self.flops, achieved)\n        if achieved > self.flops and not self.warned:",
        ("tests/test_precision.py::test_cpu_peak_is_measured_once_per_machine_and_never_raised",
         "tests/test_precision.py::test_mfu_is_against_the_cached_peak"),
    ),
    Mutant.at(
        "cpu_peak_not_cached", "the CPU peak is measured again at every start",
        "torchllm.metrics.flops:cpu_peak",
        "    if remeasure or not _usable(entry):\n        new = _checked",
        "    if True:\n        new = _checked",
        ("tests/test_precision.py::test_cpu_peak_is_measured_once_per_machine_and_never_raised",
         "tests/test_precision.py::test_mfu_is_against_the_cached_peak"),
    ),
    Mutant.at(
        "console_loss_is_the_steps_own", "the console's loss is the logging step's own, not the interval's mean",
        "torchllm.metrics.metrics_logger:MetricsLogger.log",
        "                                      loss=scalars[\"loss/interval\"]))",
        "                                      loss=None))",
        ("tests/test_metrics.py::test_console_loss_is_the_mean_over_the_logging_interval",),
    ),
    Mutant.at(
        "report_mixture_rows_as_repr", "the comparison report shows a mixture's unused data.dataset and a DataSource repr",
        "torchllm.report.markdown:_flat",
        '        flat["data.sources"] = ", ".join(f"{s.dataset} x {s.weight:g}" for s in sources)\n'
        '        flat["data.dataset"] = "(mixture: data.sources)"',
        "        pass",
        ("tests/test_report.py::test_differences_show_a_mixtures_sources_and_weights",),
    ),
    Mutant.at(
        "throughput_counts_trained_tokens", "tokens/s, MFU and tokens seen count only the trained (assistant) tokens",
        "torchllm.metrics.reduce:loss_stats",
        '    stats = {"loss": total[0] / total[1], "trained_tokens": total[1], "tokens": total[2]}',
        '    stats = {"loss": total[0] / total[1], "trained_tokens": total[1], "tokens": total[1]}',
        ("tests/test_data_chat.py::test_sft_throughput_counts_processed_tokens_and_trained_ones_apart",),
    ),
    Mutant.at(
        "next_hellaswag_ignores_local_copy", "the end block's HellaSwag command downloads although "
        "eval.hellaswag_data is a local file", "torchllm.report.hook:evals_offline",
        "    if Path(hs).is_file():", "    if False:",
        ("tests/test_report.py::test_next_lines_use_the_runs_local_eval_copies",),
    ),
    Mutant.at(
        "next_downstream_wrong_flag", "the end block's downstream command passes the local copies "
        "with a flag the CLI does not have", "torchllm.report.hook:evals_offline",
        "                      f\"--data-dir {shlex.quote(ecfg.tasks_data_dir)}\")",
        "                      f\"--data {shlex.quote(ecfg.tasks_data_dir)}\")",
        ("tests/test_report.py::test_next_lines_use_the_runs_local_eval_copies",),
    ),
    Mutant.at(
        "cpu_peak_busy_counts_as_quiet",
        "a CPU peak measured while other processes held the cores is cached as final",
        "torchllm.metrics.flops:measure_cpu_peak",
        "                 \"quiet\": share >= QUIET_SHARE and steal < 5}",
        "                 \"quiet\": True}",
        ("tests/test_cpu_peak.py::"
         "test_a_busy_measurement_is_repeated_flagged_and_measured_again_later",),
    ),
    Mutant.at(
        "cpu_peak_thread_sanity_off",
        "a 2-thread CPU peak below the 1-thread one is used as is (MFU too high)",
        "torchllm.metrics.flops:_checked",
        "    if entry[\"flops\"] < single[\"flops\"]:\n        again",
        "    if False:\n        again",
        ("tests/test_cpu_peak.py::"
         "test_a_two_thread_peak_below_the_one_thread_peak_is_measured_again_and_floored",),
    ),
    Mutant.at(
        "cpu_peak_low_single_thread_kept",
        "a 1-thread CPU peak measured under load is kept beside a quiet N-thread one (DDP ranks "
        "of one thread read MFU far above an N-thread process's)",
        "torchllm.metrics.flops:_checked",
        "        single = _one_thread_peak(dtype, cache, remeasure=True)",
        "        pass",
        ("tests/test_cpu_peak.py::"
         "test_a_one_thread_peak_below_its_share_of_the_two_thread_peak_is_measured_again",),
    ),
    Mutant.at(
        "bench_mfu_from_a_busy_peak",
        "the benchmark tables print MFU against a CPU peak measured on a busy machine",
        "benchmarks.benchlib.report:summarize",
        "r0[\"peak_flops\"] if r0.get(\"peak_quiet\", True) else None",
        "r0[\"peak_flops\"]",
        ("tests/test_bench.py::"
         "test_a_peak_measured_on_a_busy_machine_gives_no_mfu_in_the_table",),
    ),
]
