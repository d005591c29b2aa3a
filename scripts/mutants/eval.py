"""Mutants of evaluation, generation, inference loading (scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

MUTANTS = [
    Mutant.at(
        "continuation_encoded_apart",
        "a scored continuation is encoded on its own and appended to the context's ids",
        "torchllm.eval.continuation:encode_continuation",
        "    whole = tokenizer.encode(context + continuation, bos=True)\n",
        "    whole = tokenizer.encode(context, bos=True) + tokenizer.encode(continuation)\n",
        ("tests/test_eval_continuation.py::test_hellaswag_endings_are_encoded_as_the_whole_string"
         "[sp_auto]",
         "tests/test_eval_hellaswag.py::test_scoring_matches_brute_force_on_a_tiny_file",
         "tests/test_eval_downstream.py::test_scorer_matches_brute_force_on_real_rows"
         "[arc_easy-mc]"),
    ),
    Mutant.at(
        "completion_decoded_alone",
        "generate prints the completion decoded apart from its prompt (loses the boundary space)",
        "torchllm.generate:main",
        "            print(completion_text(tokenizer, prompts[i], ids), file=stdout)\n",
        "            print(readable(tokenizer, ids), file=stdout)\n",
        ("tests/test_generate.py::test_cli_prints_the_completion_as_the_whole_sequence_decodes",),
    ),
    Mutant.at(
        "interactive_completion_decoded_alone",
        "generate --interactive streams the completion decoded apart from its prompt",
        "torchllm.generate:interactive",
        "stream_completion(tokenizer, generate_stream(model, ids, **sampling), stdout, ids)",
        "stream_completion(tokenizer, generate_stream(model, ids, **sampling), stdout)",
        ("tests/test_generate_interactive.py::test_interactive_cli_answers_each_stdin_line",),
    ),
    Mutant.at(
        "hellaswag_data_dir_file_ignored",
        "the downstream HellaSwag task ignores <data_dir>/hellaswag.jsonl (needs the network)",
        "torchllm.eval.tasks:_hellaswag_rows",
        "    if jsonl is not None and jsonl.is_file():\n",
        "    if False:\n",
        ("tests/test_eval_downstream.py::"
         "test_hellaswag_task_reads_the_data_dir_file_before_eval_hellaswag_data",),
    ),
    Mutant.at(
        "eval_cli_overrides_dropped",
        "the eval CLIs accept --section.key=value overrides but load the run's config without them",
        "torchllm.eval.loading:load_for_inference",
        '    cfg = reader.config(overrides)',
        '    cfg = reader.config()',
        ("tests/test_eval_downstream.py::test_cli_applies_config_overrides",
         "tests/test_eval_hellaswag.py::test_cli_applies_config_overrides"),
    ),
    Mutant.at(
        "downstream_default_tasks_without_hellaswag",
        "the downstream CLI's default task set leaves HellaSwag out",
        "torchllm.eval.tasks:DEFAULT_TASKS",
        '"commonsense_qa", "social_iqa", "sciq", "sciq_lm", "hellaswag")',
        '"commonsense_qa", "social_iqa", "sciq", "sciq_lm")',
        ("tests/test_eval_downstream.py::"
         "test_cli_runs_the_default_tasks_offline_with_a_local_hellaswag_file",),
    ),
    Mutant.at(
        "eval_loss_bits_in_nats", "eval.loss's bits per byte counts nats",
        "torchllm.eval.loss:evaluate_loss", '    bits = m["val/loss"] * m["val/tokens"] / math.log(2)\n',
        '    bits = m["val/loss"] * m["val/tokens"]\n',
        ("tests/test_eval_loss.py::test_checkpoint_loss_equals_in_training_validation_on_the_same"
         "_windows",),
    ),
    Mutant.at(
        "generate_overrides_dropped", "generate parses --section.key=value but ignores it",
        "torchllm.generate:main",
        "        model, cfg, tokenizer = load_for_inference(args.checkpoint, device, overrides)\n",
        "        model, cfg, tokenizer = load_for_inference(args.checkpoint, device)\n",
        ("tests/test_generate.py::test_cli_takes_config_overrides_like_the_eval_clis",),
    ),
    Mutant.at(
        "harness_truncation_off_by_one", "a long request keeps max_length - 1 tokens of input, "
        "not max_length (lm-eval's hf model keeps the last max_length + 1, drops the last)",
        "torchllm.eval.harness.model:TorchllmLM._score",
        "            inputs.append((ctx + cont)[-(self.max_length + 1):][:-1])\n",
        "            inputs.append((ctx + cont)[-self.max_length:][:-1])\n",
        ("tests/test_harness.py::test_requests_equal_lm_eval_hf_model_on_the_export",),
    ),
    Mutant.at(
        "harness_rolling_scores_bos", "loglikelihood_rolling encodes the text with BOS, so "
        "the first window scores a BOS after the prefix BOS",
        "torchllm.eval.harness.model:TorchllmLM.loglikelihood_rolling",
        "            ids = self.tokenizer.encode(text)  # no BOS",
        "            ids = self.tokenizer.encode(text, bos=True)  # no BOS",
        ("tests/test_harness.py::test_requests_equal_lm_eval_hf_model_on_the_export",),
    ),
    Mutant.at(
        "harness_context_without_bos", "loglikelihood contexts are encoded without BOS",
        "torchllm.eval.harness.model:TorchllmLM.tok_encode",
        "        return self.tokenizer.encode(string, bos=add_special_tokens is not False)",
        "        return self.tokenizer.encode(string, bos=bool(add_special_tokens))",
        ("tests/test_harness.py::test_requests_equal_lm_eval_hf_model_on_the_export",
         "tests/test_harness.py::test_predictions_equal_downstream_where_the_formats_agree"),
    ),
    Mutant.at(
        "harness_scores_misordered", "a batch's scores go back to the requests in index order, "
        "not in the length-sorted order they were computed in",
        "torchllm.eval.harness.model:TorchllmLM._loglikelihood_tokens",
        "            for i, (ll, greedy) in zip(batch, self._score([pieces[i] for i in batch])):",
        "            for i, (ll, greedy) in zip(sorted(batch),\n"
        "                                       self._score([pieces[i] for i in batch])):",
        ("tests/test_harness.py::test_requests_equal_lm_eval_hf_model_on_the_export",),
    ),
    Mutant.at(
        "harness_gather_own_rank_only", "rank 0 keeps only its own documents' results",
        "torchllm.eval.harness.model:TorchllmLM.gather_object",
        "        return parts if self._rank == dst else None",
        "        return [obj] if self._rank == dst else None",
        ("tests/test_harness.py::test_two_ranks_equal_one_rank",),
    ),
    Mutant.at(
        "harness_stop_sequences_ignored", "generate_until returns the text past its stop sequence",
        "torchllm.eval.harness.model:cut_at_stop", "        if stop:\n", "        if False:\n",
        ("tests/test_harness.py::test_generate_until_stops_at_stop_sequences_and_equals_greedy_decoding",),
    ),
    Mutant.at(
        "harness_missing_lm_eval_traceback", "without lm-eval the CLI dies with a traceback",
        "torchllm.eval.harness.cli:main", "    except ImportError:\n        print(INSTALL_HINT",
        "    except OSError:\n        print(INSTALL_HINT",
        ("tests/test_harness.py::test_missing_lm_eval_is_one_clear_line",),
    ),
    Mutant.at(
        "harness_long_continuation_cut",
        "a continuation longer than max_length keeps one token of context per window",
        "torchllm.eval.harness.model:TorchllmLM._windows",
        "            pieces.append((full[max(0, end - 1 - self.max_length) : start], full[start:end]))",
        "            pieces.append((full[start - 1 : start], full[start:end]))",
        ("tests/test_harness.py::test_requests_equal_lm_eval_hf_model_on_the_export",),
    ),
    Mutant.at(
        "harness_generates_past_stop",
        "generate_until runs every request to max_gen_toks, cutting at the stop sequence after",
        "torchllm.eval.harness.model:TorchllmLM.generate_until",
        "                                     stop_when=stopped)",
        "                                     stop_when=None)",
        ("tests/test_harness.py::test_generate_until_stops_at_stop_sequences_and_equals_greedy_"
         "decoding",),
    ),
    Mutant.at(
        "harness_scores_padding",
        "a right-padded request's continuation is read at the batch's last positions (padding)",
        "torchllm.eval.harness.model:TorchllmLM._score",
        "            logp = logits[i, len(ids) - len(cont) : len(ids)].float().log_softmax(dim=-1)",
        "            logp = logits[i, tokens.shape[1] - len(cont) :].float().log_softmax(dim=-1)",
        ("tests/test_harness.py::test_every_family_scores_batched_requests_as_one_at_a_time",),
    ),
    Mutant.at(
        "val_held_out_per_local_batch",
        "the held-out set is validation.steps x local batch windows (with 1 rank accumulating, "
        "half of what 2 ranks score: val/loss depends on the layout)",
        "torchllm.eval.in_training:validation_loader",
        "        n = min(len(windows), vcfg.steps * global_batch)\n        what = (",
        "        n = min(len(windows), vcfg.steps * local)\n        what = (",
        ("tests/test_eval_validation.py::test_validation_is_the_same_on_every_layout[fsdp2]",),
    ),
    Mutant.at(
        "val_reduced_over_the_world",
        "validation sums loss and tokens over every rank, not the data-parallel group (pipeline "
        "peers count the same batch twice)",
        "torchllm.eval.in_training:Evaluator.from_context",
        "ctx.module.autocast, group=dims.dp_group,",
        "ctx.module.autocast, group=None,",
        ("tests/test_eval_validation.py::test_validation_is_the_same_on_every_layout[pp2]",),
    ),
    Mutant.at(
        "val_share_drops_the_remainder",
        "each rank's share of the held-out windows is floor(n / dp degree): the last windows are "
        "scored by one process, left out by several",
        "torchllm.eval.in_training:HeldOutBatches.__init__",
        "        share = -(-n // dp_degree)\n",
        "        share = n // dp_degree\n",
        ("tests/test_eval_validation.py::"
         "test_held_out_windows_are_shared_out_whole_in_equal_full_batches",),
    ),
    Mutant.at(
        "mixture_per_source_validation_uses_the_concatenation", "each source's validation loss is scored on the merged held-out set",
        "torchllm.eval.in_training:validation_loader",
        "                (source_label(i, src.dataset),\n                 HeldOutBatches(part,",
        "                (source_label(i, src.dataset),\n                 HeldOutBatches(windows,",
        ("tests/test_data_mixture.py::test_a_mixture_validates_each_source_on_its_own",),
    ),
    Mutant.at(
        "chat_session_forgets_history", "generate --chat --interactive answers each turn without the conversation so far",
        "torchllm.generate:chat_session",
        "            (ids,) = generate(model, [template.prompt(history)], **sampling)",
        "            (ids,) = generate(model, [template.prompt(list(system) + history[-1:])], **sampling)",
        ("tests/test_data_chat.py::test_sft_makes_the_model_reproduce_the_replies",),
    ),
    Mutant.at(
        "stop_at_loss_ignored", "validation.stop_at_loss is read but never stops the run",
        "torchllm.eval.in_training:Evaluator.on_step_end",
        "            ctx.stops.target_loss(step, loss, self.vcfg.stop_at_loss)\n",
        "",
        ("tests/test_stop_at_loss.py::test_run_train_sh_stops_at_the_target_with_a_final_checkpoint_and_report",),
    ),
]
