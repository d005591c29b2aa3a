"""Mutants of issue 53's journey: the validation set named, bounded and stoppable, eval.loss on
the run's validation set, errors that say what to do, evals offline, the eval data fetched."""

from __future__ import annotations

from mutants.base import Mutant

VS = "tests/test_validation_set.py::"
CE = "tests/test_clear_errors.py::"

MUTANTS = [
    Mutant.at(
        "dedicated_validation_holds_out_training_text",
        "a dedicated validation.dataset still holds data.val_fraction of the training text out",
        "torchllm.data:holds_out",
        "vcfg.enable and not dedicated_validation(dcfg, vcfg)",
        "vcfg.enable",
        (VS + "test_nothing_is_held_out_of_training_for_a_dedicated_validation_set",),
    ),
    Mutant.at(
        "validation_budget_unbounded",
        "validation.max_tokens = 0 (auto) reads a million tokens of the validation set",
        "torchllm.eval.in_training:token_budget",
        "    budget = max(budget, global_batch * (tcfg.seq_len + 1))\n",
        "    budget = 1_000_000\n",
        (VS + "test_the_header_names_the_validation_set_as_it_is_scored",),
    ),
    Mutant.at(
        "header_describes_the_unused_held_out_split",
        "the run header describes the held-out split, not the validation set scored",
        "torchllm.metrics.header:context_header",
        "                               ctx.val_batches or ctx.val_loader.dataset,\n",
        "                               ctx.val_loader.dataset,\n",
        (VS + "test_the_header_names_the_validation_set_as_it_is_scored",),
    ),
    Mutant.at(
        "validation_ignores_the_stop_signal",
        "a SIGTERM during a validation waits for all of its batches (torchrun kills the run)",
        "torchllm.eval.validation:validate",
        "            if stop is not None and stop():\n",
        "            if False:\n",
        (VS + "test_a_stop_signal_during_a_long_validation_saves_and_exits_0",),
    ),
    Mutant.at(
        "long_validation_silent",
        "a long validation prints no progress",
        "torchllm.eval.in_training:Evaluator.validation.progress",
        "            if steps >= self.PROGRESS_MIN_BATCHES and done % tenth == 0:\n",
        "            if False:\n",
        (VS + "test_a_stop_signal_during_a_long_validation_saves_and_exits_0",),
    ),
    Mutant.at(
        "eval_loss_scores_the_held_out_split",
        "eval.loss without --data scores data.dataset's held-out split, not validation.dataset",
        "torchllm.eval.loss:evaluation_batches",
        "    if data is not None:  # --data: that set, not the one the run validated on\n",
        "    data = data or dcfg.dataset\n    if True:\n",
        (VS + "test_eval_loss_scores_what_the_run_validated_on",
         "tests/test_eval_loss.py::"
         "test_checkpoint_loss_equals_in_training_validation_on_the_same_windows"),
    ),
    Mutant.at(
        "validation_dataset_reported_as_data_dataset",
        "a missing validation.dataset file is reported as data.dataset",
        "torchllm.data.dataset:check_data",
        "            raise as_key(e, \"validation.dataset\") from None\n",
        "            raise\n",
        (CE + "test_a_missing_validation_dataset_is_named_as_validation_dataset[run_train.sh]",),
    ),
    Mutant.at(
        "mixed_local_suffixes_unexplained",
        "a folder of .txt and .jsonl files is refused without saying how to read it",
        "torchllm.data.sources.local:local_files",
        "    if len(suffixes) != 1:  # one reader per source: .txt is one document a file, "
        ".jsonl rows\n",
        "    if len(suffixes) != 1 and False:\n",
        (CE + "test_a_folder_of_mixed_files_says_how_to_read_it",),
    ),
    Mutant.at(
        "model_info_refuses_help",
        "python -m torchllm.tools.model_info --help is an unexpected argument",
        "torchllm.tools.model_info:main",
        "    if asks_help(argv, __doc__):\n",
        "    if False:\n",
        (CE + "test_the_tools_answer_help[model_info]",),
    ),
    Mutant.at(
        "estimate_memory_refuses_help",
        "python -m torchllm.tools.estimate_memory --help is an unexpected argument",
        "torchllm.tools.estimate_memory:main",
        "    if asks_help(argv, __doc__):\n",
        "    if False:\n",
        (CE + "test_the_tools_answer_help[estimate_memory]",),
    ),
    Mutant.at(
        "config_error_printed_twice",
        "a worker's config error is printed by the worker and again by the launcher",
        "torchllm.run.failures:log_failure",
        "        if os.environ.get(STATUS_DIR_ENV):  # torchllm.run.launch prints it, once\n",
        "        if False:\n",
        (CE + "test_a_workers_config_error_is_printed_once",),
    ),
    Mutant.at(
        "hellaswag_retries_the_hub",
        "eval.hellaswag offline retries the Hub (~25 s) instead of probing it first",
        "torchllm.eval.hellaswag:load_examples",
        "        offline = False if path.exists() else prepare_hub()\n",
        "        offline = False\n",
        (CE + "test_hellaswag_offline_fails_at_once_saying_so",),
    ),
    Mutant.at(
        "downstream_retries_the_hub",
        "eval.downstream offline retries the Hub (~25 s) instead of probing it first",
        "torchllm.eval.tasks:load_rows",
        "    offline = prepare_hub()  # offline: fail at once rather than retry the Hub for "
        "~25 s\n",
        "    offline = False\n",
        (CE + "test_downstream_offline_fails_at_once_naming_the_fetch_command",),
    ),
    Mutant.at(
        "local_harness_task_reaches_the_hub",
        "a shipped _local harness task without its local copy falls back to the Hub",
        "torchllm.eval.harness.data:_dataset",
        "    return datasets.Dataset.from_list(load_rows(name, data_dir, hellaswag_data, "
        "hub=False))\n",
        "    return datasets.Dataset.from_list(load_rows(name, data_dir, hellaswag_data))\n",
        (CE + "test_local_harness_tasks_never_reach_the_hub",),
    ),
    Mutant.at(
        "fetch_copies_unchecked",
        "eval.fetch --from copies a file without reading it as the task does",
        "torchllm.eval.fetch:from_file",
        "        items = load_items(task, str(staging), hub=False)  # checked as an eval reads "
        "it\n",
        "        items = []\n",
        (CE + "test_one_command_prepares_the_eval_data_the_evals_read_offline",),
    ),
    Mutant.at(
        "many_epochs_unwarned",
        "a small chat file packed into a few windows and read hundreds of times: no warning",
        "torchllm.metrics.header:data_warnings",
        "        if epochs > MANY_EPOCHS:\n",
        "        if False:\n",
        (CE + "test_the_shipped_sft_config_on_a_small_chat_file_warns",),
    ),
    Mutant.at(
        "empty_validation_split_unwarned",
        "a held-out validation split of 0 windows goes unsaid",
        "torchllm.metrics.header:data_warnings",
        "    if (held is not None and len(val_dataset) == 0 and dcfg.val_fraction > 0\n",
        "    if (held is not None and len(val_dataset) < 0 and dcfg.val_fraction > 0\n",
        (CE + "test_the_shipped_sft_config_on_a_small_chat_file_warns",
         "tests/test_header_fixes.py::"
         "test_a_held_out_split_of_no_windows_is_warned_of_only_when_it_is_held_out"),
    ),
    Mutant.at(
        "report_plots_single_steps",
        "the report's loss plot draws the single logged steps, not the console's interval means",
        "torchllm.report.plots:PLOTS",
        "(\"loss/interval|loss/avg\", \"val/loss|val/*/loss\"),",
        "(\"loss/avg\", \"val/loss|val/*/loss\"),",
        ("tests/test_report.py::test_the_run_writes_a_report_whose_plots_are_the_events_values",),
    ),
    Mutant(
        "exports_not_ignored",
        "hf/ (the exports the end-of-run block suggests) is not git-ignored",
        ".gitignore",
        "/hf/\n",
        "",
        (CE + "test_exported_folders_are_ignored_by_git_but_the_hf_package_is_not",),
    ),
]
