"""Mutants of training checkpoints: save, retention, resume, the reader, trust (scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

MUTANTS = [
    Mutant(
        "scheduler_not_restored", "a resumed run starts the LR schedule from step 0",
        "torchllm/checkpoint/checkpointer.py",
        "        if lr_scheduler is not None:\n",
        "        if False:\n",
        ("tests/test_checkpoint.py::test_stop_after_steps_then_continue_matches_schedule",),
    ),
    Mutant(
        "optimizer_not_restored_on_fallback",
        "checkpoints lose the optimizer state (seen when falling back past a corrupt one)",
        "torchllm/checkpoint/checkpointer.py",
        "            self.states[\"optimizer\"] = OptimizerState(model, optimizer)\n",
        "            pass\n",
        ("tests/test_checkpoint.py::test_corrupt_checkpoint_falls_back_to_earlier_one",),
    ),
    Mutant(
        "gpt2_optimizer_not_restored", "GPT-2 resumes without its optimizer state",
        "torchllm/checkpoint/checkpointer.py",
        "            self.states[\"optimizer\"] = OptimizerState(model, optimizer)\n",
        "            pass\n",
        ("tests/test_gpt2.py::test_trains_and_resumes_through_the_trainer",),
    ),
    Mutant(
        "rng_not_restored", "a resumed run keeps the process's torch RNG state",
        "torchllm/checkpoint/state.py",
        "        torch.set_rng_state(state[\"torch\"])\n",
        "",
        ("tests/test_checkpoint.py::test_split_run_equals_straight_run_bit_for_bit",),
    ),
    Mutant(
        "initial_load_model_only_ignored", "initial_load_path always loads the whole state",
        "torchllm/checkpoint/loading.py",
        "            model_only = self.cfg.initial_load_model_only\n",
        "            model_only = False\n",
        ("tests/test_checkpoint.py::test_initial_load_model_only_or_full_state",),
    ),
    Mutant(
        "unreadable_marker_skips_checksums",
        "an empty or garbage COMPLETE marker reads as a record without a file list, so the step "
        "loads unverified", "torchllm/checkpoint/reader.py",
        '        raise MarkerError(f"marker {marker} is {what}") from None\n',
        "        return {}\n",
        ("tests/test_resume_safety.py::test_unreadable_marker_is_an_unusable_step",),
    ),
    Mutant(
        "grown_vocab_rows_zero", "rows grown at a stage boundary start at zero, not the mean",
        "torchllm/checkpoint/vocab_resize.py",
        "    mean = flat.mean(0)\n",
        "    mean = torch.zeros_like(flat[0])\n",
        ("tests/test_stage_boundaries.py::"
         "test_new_stage_with_chat_tokens_grows_the_vocab_rows_to_their_mean",),
    ),
    Mutant(
        "object_store_partial_step_kept",
        "a step prefix without a marker (an upload cut short) stays on the store forever",
        "torchllm/checkpoint/loading.py",
        "                    delete_step(step_dir(self.folder, step))\n",
        "                    pass\n",
        ("tests/test_object_storage.py::test_flipped_byte_in_a_shard_object_falls_back_and_"
         "partial_steps_are_deleted",),
    ),
    Mutant(
        "object_store_crc_not_compared",
        "a same-size flipped byte in a shard object loads silently (only sizes are checked)",
        "torchllm/checkpoint/integrity.py", '        if crc != want["crc32"]:\n',
        "        if False:\n",
        ("tests/test_object_storage.py::test_flipped_byte_in_a_shard_object_falls_back_and_"
         "partial_steps_are_deleted",),
    ),
    Mutant(
        "step_list_not_updated_by_saves",
        "the checkpointer's cached step list misses its own saves: retention never deletes",
        "torchllm/checkpoint/retention.py", "        self.known(agree).append(step)\n", "",
        ("tests/test_checkpoint.py::test_retention_keeps_exactly_k",),
    ),
    Mutant(
        "object_store_prefix_not_own",
        "deleting step-1 on a store deletes every key starting with step-1 (step-10 too)",
        "torchllm/storage.py",
        '            return self.fs.find(self._key(folder) + "/")\n',
        '            return [k for k in self.fs.find(parent_of(self._key(folder)) + "/")\n'
        '                    if k.startswith(self._key(folder))]\n',
        ("tests/test_object_storage.py::test_steps_on_a_bucket_complete_partial_and_their_own_"
         "prefix",),
    ),
    Mutant(
        "golden_checkpoint_key_renamed",
        "a refactor renames a checkpoint state key: its own saves load, older checkpoints do not",
        "torchllm/checkpoint/checkpointer.py",
        'self.states["train_state"] = PickledState(train_state)',
        'self.states["trainer_state"] = PickledState(train_state)',
        ("tests/test_golden_curves.py::test_recorded_checkpoint_resumes_exactly",),
    ),
    Mutant(
        "metadata_plain_pickle",
        "the checkpoint reader unpickles .metadata with plain pickle (a payload runs)",
        "torchllm/checkpoint/safe_load.py",
        "            metadata = restricted_load(stream.read(), METADATA_GLOBALS, str(path))",
        "            metadata = pickle.loads(stream.read())",
        ("tests/test_checkpoint_trust.py::test_convert_and_inference_loading_refuse_a_flipped_byte_or_code",
         "tests/test_checkpoint_trust.py::test_fsspec_checkpoints_are_read_through_the_allow_list"),
    ),
    Mutant(
        "pickled_state_plain_pickle",
        "torchllm's pickled states (scheduler, data position, counters) load with pickle.loads",
        "torchllm/checkpoint/state.py",
        "        self.obj.load_state_dict(load_state_pickle(sd[\"pickle\"], where))",
        "        self.obj.load_state_dict(pickle.loads(sd[\"pickle\"]))",
        ("tests/test_checkpoint_trust.py::test_pickled_state_loads_plain_pickles_of_data_and_refuses_code",),
    ),
    Mutant(
        "stored_values_not_weights_only",
        "DCP's non-tensor values load with torch.load(weights_only=False)",
        "torchllm/checkpoint/safe_load.py",
        "            return torch.load(io.BytesIO(data), map_location=\"cpu\", weights_only=True)",
        "            return torch.load(io.BytesIO(data), map_location=\"cpu\", weights_only=False)",
        ("tests/test_checkpoint_trust.py::test_stored_values_load_as_data_only",),
    ),
    Mutant(
        "reader_passes_bytes_unchecked",
        "the reader hands DCP's planner the bytes values unchecked (its torch.load is unsafe)",
        "torchllm/checkpoint/safe_load.py",
        "        return super().read_data(plan, _SafeBytesPlanner(planner, self))",
        "        return super().read_data(plan, planner)",
        ("tests/test_checkpoint_trust.py::test_dcp_reads_of_poisoned_values_are_refused_naming_the_file",),
    ),
    Mutant(
        "inference_skips_checksums",
        "generate, the evals and convert read a checkpoint without its COMPLETE CRC-32s",
        "torchllm/checkpoint/reader.py",
        "    problem = reader.verify()\n",
        "    problem = None\n",
        ("tests/test_checkpoint_trust.py::test_convert_and_inference_loading_refuse_a_flipped_byte_or_code",),
    ),
    Mutant(
        "resume_falls_back_from_untrusted",
        "a resume treats a value that would run code as a read error and falls back",
        "torchllm/checkpoint/restore.py",
        "            problem, misfit = describe_failure(e), untrusted_cause(e)  # code in it: stop",
        "            problem, misfit = describe_failure(e), None",
        ("tests/test_checkpoint_trust.py::"
         "test_run_train_sh_resume_refuses_a_checkpoint_that_runs_code[pickled_state]",),
    ),
    Mutant(
        "new_vocab_rows_all_the_mean",
        "new token rows all start equal to the mean row (transformers draws them around it)",
        "torchllm/checkpoint/vocab_resize.py",
        "    if int(info) == 0:  # positive definite",
        "    if False:  # positive definite",
        ("tests/test_vocab_rows.py::test_new_rows_are_drawn_as_transformers_draws_them",),
    ),
    Mutant(
        "new_vocab_rows_full_covariance",
        "new token rows drawn with the old rows' full covariance (transformers scales it by 1e-9)",
        "torchllm/checkpoint/vocab_resize.py",
        "    covariance = 1e-9 * (centered.T @ centered / saved_vocab)",
        "    covariance = centered.T @ centered / saved_vocab",
        ("tests/test_vocab_rows.py::test_new_rows_are_drawn_as_transformers_draws_them",),
    ),
    Mutant(
        "store_error_before_save_uncaught",
        "a store error clearing the step before a save (botocore's, no OSError) escapes "
        "checkpoint.on_save_error as a traceback",
        "torchllm/checkpoint/saver.py",
        "            except Exception as e:  # noqa: BLE001 - any store error (botocore's are no "
        "OSError)\n",
        "            except OSError as e:\n",
        ("tests/test_store_errors.py::test_a_refusing_store_is_a_save_error_not_a_traceback",),
    ),
    Mutant(
        "store_timeout_not_applied",
        "checkpoint.store_timeout_s is never handed to the object-store client (a stalled store "
        "blocks a save for many minutes)",
        "torchllm/checkpoint/checkpointer.py",
        "        set_store_timeout(ccfg.store_timeout_s)\n",
        "",
        ("tests/test_store_errors.py::"
         "test_a_stalled_store_fails_the_save_in_time_and_continue_keeps_training",),
    ),
    Mutant(
        "disk_full_short_write_unrecognised",
        "torch.save's short write on a full disk ('unexpected pos') is not recognised as a full "
        "disk",
        "torchllm/checkpoint/integrity.py",
        '        if "unexpected pos" in str(x) or "No space left on device" in str(x):',
        '        if False:',
        ("tests/test_store_errors.py::"
         "test_torch_saves_errno_less_short_write_counts_as_a_full_disk",),
    ),
    Mutant(
        "no_room_check_at_launch",
        "a launch on a disk without room for one save trains until its first save",
        "torchllm/checkpoint/checkpointer.py",
        "            self._check_room(model, optimizer)\n",
        "            pass\n",
        ("tests/test_store_errors.py::test_a_launch_on_a_full_disk_is_refused_before_step_1",),
    ),
    Mutant(
        "retention_counts_unhealthy_steps",
        "retention counts steps saved while the guard skipped updates: a bad stretch evicts the "
        "last good checkpoint",
        "torchllm/checkpoint/retention.py",
        "        good = [s for s in known if s not in self.not_resumable]\n",
        "        good = list(known)\n",
        ("tests/test_resume_trust.py::test_bad_stretch_keeps_the_last_good_checkpoint_and_a_relaunch_resumes_it",),
    ),
    Mutant(
        "weights_only_resumed_as_full_state",
        "a resume takes the newest complete step even when it holds weights only",
        "torchllm/checkpoint/loading.py",
        "        good = [s for s in steps if s not in skip or s == 0]\n",
        "        good = list(steps)\n",
        ("tests/test_resume_trust.py::test_weights_only_final_save_is_passed_over_for_the_full_state",),
    ),
    Mutant(
        "resumed_lr_from_old_schedule",
        "the first resumed step's LR is the one the checkpoint's schedule set (training.steps "
        "changed), not this config's",
        "torchllm/checkpoint/restore.py",
        "            current_lr(self.optimizer, self.lr_scheduler)\n",
        "            pass\n",
        ("tests/test_resume_trust.py::test_weights_only_final_save_is_passed_over_for_the_full_state",),
    ),
    Mutant(
        "data_restart_keeps_position",
        "on_data_change = 'restart' says so but still loads the old data position",
        "torchllm/checkpoint/restore.py",
        '        return [*exclude, "dataloader"]\n',
        "        return exclude\n",
        ("tests/test_resume_trust.py::test_resume_with_changed_data_says_what_changed_and_restarts_or_refuses[seq_len]",),
    ),
    Mutant(
        "tokenizer_identity_by_size", "another tokenizer of the same size passes (the SHA-256 "
        "is not compared)", "torchllm/checkpoint/tokenizer_identity.py",
        "    if a and b:\n        same = a == b\n", "    if a and b:\n        same = True\n",
        ("tests/test_stage_tokenizer.py::"
         "test_resuming_with_another_tokenizer_of_the_same_size_names_both",
         "tests/test_stage_tokenizer.py::"
         "test_generate_never_trains_a_missing_tokenizer_nor_takes_another"),
    ),
    Mutant(
        "stage_train_choice_refused", "data.tokenizer = 'train' at a stage is refused like any "
        "other tokenizer (no way to choose a new one)",
        "torchllm/checkpoint/tokenizer_identity.py",
        '    if use == "initial load" and now.get("new"):\n', "    if False:\n",
        ("tests/test_stage_tokenizer.py::"
         "test_a_stage_on_new_data_keeps_its_checkpoints_tokenizer",),
    ),
    Mutant(
        "hf_stage_reads_tokenizer_json_only", "a Hugging Face folder's tokenizer.model (a "
        "SentencePiece export) is not its tokenizer",
        "torchllm/checkpoint/tokenizer_identity.py",
        'HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")\n',
        'HF_TOKENIZER_FILES = ("tokenizer.json",)\n',
        ("tests/test_stage_tokenizer.py::"
         "test_a_stage_from_a_hugging_face_export_keeps_its_tokenizer",),
    ),
    Mutant(
        "inference_reads_unhealthy_newest", "generate / export of a run read the step saved while updates were skipped",
        "torchllm/checkpoint/reader.py",
        "            return _newest_healthy(folder, steps)",
        "            return step_dir(folder, steps[-1])",
        ("tests/test_resume_trust.py::test_bad_stretch_keeps_the_last_good_checkpoint_and_a_relaunch_resumes_it",),
    ),
    Mutant(
        "pickled_state_storage_plain_load", "a pickled state's tensor storage is read by torch's own _load_from_bytes (unpickles anything)",
        "torchllm/checkpoint/safe_load.py",
        "        return SAFE_STANDINS.get((module, name)) or super().find_class(module, name)",
        "        return super().find_class(module, name)",
        ("tests/test_checkpoint_trust.py::test_pickled_state_with_tensors_loads_and_their_storage_is_data_only",),
    ),
    Mutant(
        "storage_resolved_per_call", "storage_for makes a new file system (and checks the "
        "protocol's package) on every call instead of once per protocol",
        "torchllm/storage.py",
        "@lru_cache(maxsize=None)\ndef _storage_of(",
        "def _storage_of(",
        ("tests/test_storage_leaf.py::test_each_protocol_is_resolved_once",),
    ),
    Mutant(
        "resume_hparams_from_a_table", "a resume says which optimizer keys the checkpoint keeps "
        "from a fixed (AdamW + Muon) table instead of the run's OptimizerSpec",
        "torchllm/checkpoint/resume.py",
        '    hparams = resume_hparams(*{str(c.get("optimizer.name", "adamw")) for c in (old, new)})\n',
        '    hparams = {"optimizer." + k for k in ("lr", "beta1", "beta2", "eps", "weight_decay",\n'
        '                                          "muon_lr", "muon_momentum")}\n',
        ("tests/test_optimizer_plugin.py::"
         "test_toy_optimizer_trains_and_resumes_exactly_through_the_trainer",),
    ),
    # file, store errors under on_save_error = 'stop' ---
    Mutant(
        "dcp_initial_load_tokenizer_unchecked", "a stage from a DCP checkpoint (initial_load_path) "
        "accepts another tokenizer of the same size: only a resume compares the SHA-256",
        "torchllm/checkpoint/vocab_resize.py",
        '    check_same_tokenizer(saved, now, f"checkpoint {path}", "resume" if resume else '
        '"initial load")\n',
        '    if resume:\n        check_same_tokenizer(saved, now, f"checkpoint {path}", "resume")\n',
        ("tests/test_stage_tokenizer.py::test_a_stage_from_a_dcp_checkpoint_with_another_"
         "tokenizer_of_the_same_size_names_both",),
    ),
    Mutant(
        "hub_name_against_file_passes", "a tokenizer by Hub name against one by file passes "
        "unchecked (no SHA-256 on one side)", "torchllm/checkpoint/tokenizer_identity.py",
        "        same = digest == (a or b)\n",
        "        same = True\n",
        ("tests/test_stage_tokenizer.py::test_a_hub_name_against_a_file_is_compared_by_the_"
         "cached_copy_or_refused",),
    ),
    Mutant(
        "disk_full_not_recognised", "a save failing on a full disk (ENOSPC from DCP's writer) "
        "is reported as a generic I/O error, without 'no space left on' and the bytes needed",
        "torchllm/checkpoint/integrity.py",
        "    seen, todo = set(), [e]\n",
        "    seen, todo = set(), []\n",
        ("tests/test_store_errors.py::test_a_disk_that_fills_during_a_save_is_named",),
    ),
    Mutant(
        "lora_resume_optimizer_not_restored",
        "a resume loads the weights but not the optimizer state (the adapters' AdamW moments)",
        "torchllm/checkpoint/loading.py",
        "            error = self.restore.load(path, self.cfg.exclude_from_loading, resume=True)",
        "            error = self.restore.load(path, [*self.cfg.exclude_from_loading, "
        "\"optimizer\"],\n                                      resume=True)",
        ("tests/test_lora.py::test_shipped_config_trains_adapters_only_resumes_exactly_and_exports",),
    ),
    Mutant(
        "lora_resume_adam_step_behind",
        "a resume restores the optimizer's moments with the step counters of the step before",
        "torchllm/checkpoint/state.py",
        "        set_optimizer_state_dict(self.model, self.optimizer, sd)",
        "        for s in sd.get(\"state\", {}).values():\n"
        "            s[\"step\"] = s[\"step\"] - 1\n"
        "        set_optimizer_state_dict(self.model, self.optimizer, sd)",
        ("tests/test_lora.py::test_shipped_config_trains_adapters_only_resumes_exactly_and_exports",),
    ),
    Mutant(
        "nonfinite_by_float32_sum",
        "the before-save NaN check sums in float32: finite 1000 x 1e36 marks a step NONFINITE",
        "torchllm/checkpoint/integrity.py",
        "    return torch.isfinite(t).all()\n",
        "    return torch.sum(t, dtype=torch.float32).isfinite()\n",
        ("tests/test_nonfinite_check.py::test_finite_values_whose_sum_overflows_are_saved_complete",),
    ),
    Mutant(
        "nonfinite_skips_tensor_subclasses",
        "the before-save NaN check skips torchao's 8-bit optimizer states",
        "torchllm/checkpoint/integrity.py",
        "        names, _ = t.__tensor_flatten__()\n",
        "        return None\n",
        ("tests/test_nonfinite_check.py::test_nonfinite_in_a_torchao_8bit_optimizer_state_is_counted[scale]",
         "tests/test_nonfinite_check.py::test_nonfinite_in_a_torchao_8bit_optimizer_state_is_counted[qmap]"),
    ),
]
