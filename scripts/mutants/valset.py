"""Mutants of a named validation set scored across all of it, named in its tags and its header
(issue 63, item 6; scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

S = "tests/test_validation_spread.py::"
D = "tests/test_validation_dataset.py::"
O = "tests/test_validation_off.py::"

MUTANTS = [
    Mutant.at(
        "valset_first_windows", "a named validation set is scored on its first windows (a "
        "sliver of its start), not windows spread over all of it",
        "torchllm.eval.in_training:spread_ids",
        "    return [i * available // n for i in range(max(n, 0))]",
        "    return list(range(max(n, 0)))",
        (D + "test_the_whole_file_is_validated_every_time",),
    ),
    Mutant.at(
        "valset_read_to_budget", "a named set is read only up to its token budget (its start), "
        "as a stream is", "torchllm.data:whole_stream",
        "max_tokens if dataset.source.streams else None", "max_tokens",
        (S + "test_a_named_set_is_scored_on_windows_spread_over_all_of_it",),
    ),
    Mutant.at(
        "valset_size_unsaid", "the header counts the scored windows as the set's size",
        "torchllm.eval.in_training:validation_loader",
        "all its {count(len(windows.whole), 'window')}", "all its {count(n, 'window')}",
        (S + "test_a_named_set_is_scored_on_windows_spread_over_all_of_it",),
    ),
    Mutant.at(
        "valset_tag_unnamed", "a named validation set's loss is logged as val/loss, like the "
        "held-out split's", "torchllm.eval.in_training:validation_loader",
        '        batches.tag = f"val/{set_label(name)}"', '        batches.tag = "val"',
        (S + "test_its_tensorboard_tags_name_it_and_are_documented",
         S + "test_a_named_set_is_scored_on_windows_spread_over_all_of_it"),
    ),
    Mutant.at(
        "valset_report_misses_named", "the report's summary reads val/loss only: a run "
        "validated on a named set shows no validation loss",
        "torchllm.report.markdown:summary_rows",
        "    if val is None:  # a dedicated validation set",
        "    if False:  # a dedicated validation set",
        (S + "test_the_report_draws_and_summarizes_a_named_set",),
    ),
    Mutant.at(
        "valset_off_still_holds_out", "with validation off, data.val_fraction of a corpus or "
        "a chat file is still held out and never trained", "torchllm.data:holds_out",
        "    return vcfg.enable and not dedicated_validation(dcfg, vcfg)",
        "    return not dedicated_validation(dcfg, vcfg)",
        (O + "test_a_corpus_trains_on_all_of_its_text_with_validation_off",
         O + "test_conversations_train_on_every_window_with_validation_off"),
    ),
    Mutant.at(
        "valset_eval_loss_trained_on_unsaid", "eval.loss on a run that held nothing out scores "
        "trained-on windows as if held out, silently", "torchllm.eval.loss:evaluation_batches",
        "    if own and held_nothing and not vcfg.split:",
        "    if False:",
        (O + "test_a_corpus_trains_on_all_of_its_text_with_validation_off",),
    ),
]
