"""Mutants of the journey, round 6 (issue 63): numbers and messages that say what they are."""

from __future__ import annotations

from mutants.base import Mutant

ROUND6 = "tests/test_journey_round6.py::"

MUTANTS = [
    Mutant.at(
        "hub_refusal_said_as_timeout",
        "a Hub that refuses the connection at once is described as not answering within 3 s",
        "torchllm.hub:hub_reachable",
        '                _state["why"] = (f"did not answer within {timeout:g} s"\n'
        "                                 if isinstance(e, TimeoutError) else\n",
        '                _state["why"] = (f"did not answer within {timeout:g} s"\n'
        "                                 if True else\n",
        (f"{ROUND6}test_an_offline_hub_is_described_as_it_answered",),
    ),
    Mutant.at(
        "downstream_negative_zero", "the downstream table prints -0.0000 for a task at chance",
        "torchllm.eval.downstream:unsigned_zero",
        "    return round(value, digits) + 0.0 if round(value, digits) == 0 else value\n",
        "    return value\n",
        (f"{ROUND6}test_a_centered_accuracy_a_hair_below_chance_prints_as_zero",),
    ),
    Mutant(
        "run_train_sh_changes_directory",
        "run_train.sh changes into the clone, so the user's relative paths resolve there",
        "run_train.sh",
        'here="$(cd "$(dirname "$0")" && pwd)"\n',
        'here="$(cd "$(dirname "$0")" && pwd)"\ncd "$here"\n',
        (f"{ROUND6}test_paths_resolve_where_the_user_stands_not_in_the_clone",),
    ),
    Mutant.at(
        "not_found_names_no_path", "a relative path not found is named without where it looked",
        "torchllm.storage:shown",
        '    return f"{location} (= {Path(location).absolute()}, from the current directory)"\n',
        "    return str(location)\n",
        (f"{ROUND6}test_a_path_not_found_names_where_it_looked",),
    ),
    Mutant.at(
        "relayout_refused",
        "a resume on another data-parallel degree cannot continue the global batch order",
        "torchllm.data.loader:TrainLoader._relayout",
        "        windows = int(dataset_state[\"yielded\"]) * batch * int(state[\"dp_degree\"])\n",
        "        return False\n",
        ("tests/test_data.py::"
         "test_resume_under_another_dp_degree_continues_the_global_order_or_is_refused",
         f"{ROUND6}test_a_resume_on_another_rank_count_continues_the_global_batch_order_exactly"),
    ),
    Mutant.at(
        "extra_rank_starts_its_data_fresh",
        "a rank the checkpoint holds no data position for reads the data from its beginning",
        "torchllm.checkpoint.resume.restore:Restore._wanted",
        "                wanted[\"dataloader_dp0\"] = state\n",
        "                continue\n",
        (f"{ROUND6}test_a_resume_on_another_rank_count_continues_the_global_batch_order_exactly",),
    ),
    Mutant(
        "bench_rounds_back_to_back",
        "bench_parallel runs a variant's rounds back to back, so a burst of load hits one variant",
        "benchmarks/bench_parallel.py",
        "    for _ in range(args.repeats):\n        for i, v in enumerate(args.variants):\n",
        "    for i, v in enumerate(args.variants):\n        for _ in range(args.repeats):\n",
        ("tests/test_bench.py::"
         "test_rounds_are_interleaved_and_a_row_is_their_median_with_the_spread_and_load",),
    ),
    Mutant.at(
        "bench_row_is_the_last_round", "a benchmark row reports its last round, not the median",
        "benchmarks.benchlib.rounds:combine",
        '           "tokens_per_s": statistics.median(speeds),\n',
        '           "tokens_per_s": speeds[-1],\n',
        ("tests/test_bench.py::"
         "test_rounds_are_interleaved_and_a_row_is_their_median_with_the_spread_and_load",),
    ),
    Mutant.at(
        "healed_summary_counts_the_run",
        "a healed replica group's end-of-run block counts the live group's tokens as its own",
        "torchllm.report.hook:RunReport.end_block",
        "        tokens = self.launch_tokens\n",
        "        tokens = ctx.train_state.tokens_seen\n",
        (f"{ROUND6}test_a_healed_groups_summary_counts_this_launchs_tokens",
         "tests/test_fault_tolerance.py::"
         "test_a_killed_group_is_dropped_and_its_relaunch_heals_and_trains_in_step"),
    ),
    Mutant.at(
        "report_prints_tensorboards_purge",
        "reading a resumed run's events prints TensorBoard's 'TensorFlow restart ... Purging' line",
        "torchllm.report.events:read_events",
        "    tb_logger.setLevel(logging.ERROR)\n",
        "    pass\n",
        (f"{ROUND6}test_the_report_reads_a_relaunchs_events_without_tensorboards_purge_message",),
    ),
    Mutant.at(
        "report_hardware_last_launch_only", "the report's hardware line shows the last launch only",
        "torchllm.report.hook:RunReport.on_train_start",
        "                        hardware_launches=[h for h in earlier if h != here] + [here])\n",
        "                        hardware_launches=[here])\n",
        (f"{ROUND6}test_the_reports_hardware_line_names_every_launchs_machine",),
    ),
    Mutant(
        "report_loss_label_cut_off", "the loss plot's y label is longer than its panel",
        "torchllm/report/plots.py",
        '(Panel("loss (nats/token)",',
        '(Panel("loss (train: each log interval\'s mean, as the console)",',
        (f"{ROUND6}test_every_report_plot_label_fits_in_its_figure",),
    ),
]
