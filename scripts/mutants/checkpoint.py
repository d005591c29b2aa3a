"""Mutants of training checkpoints: save, retention, resume, the reader, trust (scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

IDENTITY = "tests/test_identity_trust.py::"

MUTANTS = [
    Mutant.at(
        "scheduler_not_restored", "a resumed run starts the LR schedule from step 0",
        "torchllm.train_module:TrainModule.pieces",
        ',\n                Piece("lr_scheduler", self.lr_scheduler)]',
        "]",
        ("tests/test_checkpoint.py::test_stop_after_steps_then_continue_matches_schedule",),
    ),
    Mutant.at(
        "optimizer_not_restored_on_fallback",
        "checkpoints lose the optimizer state (seen when falling back past a corrupt one)",
        "torchllm.checkpoint.training_state:TrainingState.saved_states",
        "for p in self.pieces.values()}",
        "for p in self.pieces.values() if p.kind != OPTIMIZER}",
        ("tests/test_checkpoint.py::test_corrupt_checkpoint_falls_back_to_earlier_one",),
    ),
    Mutant.at(
        "gpt2_optimizer_not_restored", "GPT-2 resumes without its optimizer state",
        "torchllm.checkpoint.training_state:TrainingState.saved_states",
        "for p in self.pieces.values()}",
        "for p in self.pieces.values() if p.kind != OPTIMIZER}",
        ("tests/test_gpt2.py::test_trains_and_resumes_through_the_trainer",),
    ),
    Mutant.at(
        "rng_not_restored", "a resumed run keeps the process's torch RNG state",
        "torchllm.checkpoint.state:RNGState.load_state_dict",
        "        torch.set_rng_state(state[\"torch\"])\n",
        "",
        ("tests/test_checkpoint.py::test_split_run_equals_straight_run_bit_for_bit",),
    ),
    Mutant.at(
        "initial_load_model_only_ignored", "initial_load_path always loads the whole state",
        "torchllm.checkpoint.resume.loading:Resume.start",
        "            model_only = self.cfg.initial_load_model_only\n",
        "            model_only = False\n",
        ("tests/test_checkpoint.py::test_initial_load_model_only_or_full_state",),
    ),
    Mutant.at(
        "unreadable_marker_skips_checksums",
        "an empty or garbage COMPLETE marker reads as a record without a file list, so the step "
        "loads unverified", "torchllm.checkpoint.layout:parse_marker",
        '        raise MarkerError(f"marker {where} is {what}") from None\n',
        "        return {}\n",
        ("tests/test_resume_safety.py::test_unreadable_marker_is_an_unusable_step",),
    ),
    Mutant.at(
        "grown_vocab_rows_zero", "rows grown at a stage boundary start at zero, not the mean",
        "torchllm.checkpoint.stage.vocab_resize:grow_rows",
        "    mean = flat.mean(0)\n",
        "    mean = torch.zeros_like(flat[0])\n",
        ("tests/test_stage_boundaries.py::"
         "test_new_stage_with_chat_tokens_grows_the_vocab_rows_to_their_mean",),
    ),
    Mutant.at(
        "object_store_partial_step_kept",
        "a step prefix without a marker (an upload cut short) stays on the store forever",
        "torchllm.checkpoint.resume.loading:Resume._clean_partial",
        "                    self.folder.delete(step)\n",
        "                    pass\n",
        ("tests/test_object_storage.py::test_flipped_byte_in_a_shard_object_falls_back_and_"
         "partial_steps_are_deleted",),
    ),
    Mutant.at(
        "object_store_crc_not_compared",
        "a same-size flipped byte in a shard object loads silently (only sizes are checked)",
        "torchllm.checkpoint.integrity:verify_files", '        if crc != want["crc32"]:\n',
        "        if False:\n",
        ("tests/test_object_storage.py::test_flipped_byte_in_a_shard_object_falls_back_and_"
         "partial_steps_are_deleted",),
    ),
    Mutant.at(
        "step_list_not_updated_by_saves",
        "the checkpointer's cached step list misses its own saves: retention never deletes",
        "torchllm.checkpoint.resume.retention:Retention.add", "        self.known(agree).append(step)\n", "",
        ("tests/test_checkpoint.py::test_retention_keeps_exactly_k",),
    ),
    Mutant.at(
        "object_store_prefix_not_own",
        "deleting step-1 on a store deletes every key starting with step-1 (step-10 too)",
        "torchllm.storage:FsspecStorage._objects",
        '            return self.fs.find(self._key(folder) + "/")\n',
        '            return [k for k in self.fs.find(parent_of(self._key(folder)) + "/")\n'
        '                    if k.startswith(self._key(folder))]\n',
        ("tests/test_object_storage.py::test_steps_on_a_bucket_complete_partial_and_their_own_"
         "prefix",),
    ),
    Mutant.at(
        "golden_checkpoint_key_renamed",
        "a refactor renames a checkpoint state key: its own saves load, older checkpoints do not",
        "torchllm.train:Trainer._training_state",
        'state.add("train_state", self.train_state)',
        'state.add("trainer_state", self.train_state)',
        ("tests/test_golden_curves.py::test_recorded_checkpoint_resumes_exactly",),
    ),
    Mutant.at(
        "legacy_index_unpickled",
        "the reader falls back to DCP's own pickle.load for an index that is not JSON (an older "
        "torchllm's: the payload runs, pathlib's classes change)",
        "torchllm.checkpoint.index:decode_index",
        "        raise legacy_refusal(where, step)\n",
        "        return pickle.loads(data)\n",
        ("tests/test_checkpoint_step.py::test_a_pickle_index_is_refused_naming_the_conversion",
         "tests/test_checkpoint_trust.py::test_convert_and_inference_loading_refuse_a_flipped_byte_or_code",
         "tests/test_checkpoint_trust.py::test_fsspec_checkpoints_are_read_as_data"),
    ),
    Mutant.at(
        "json_state_reads_legacy_pickle",
        "torchllm's small states (scheduler, data position, counters) still load an older "
        "checkpoint's pickle with pickle.loads",
        "torchllm.checkpoint.state:JSONState.load_state_dict",
        '        if "json" not in sd or not isinstance(sd["json"], str):\n',
        '        if "pickle" in sd:\n'
        '            return self.obj.load_state_dict(__import__("pickle").loads(sd["pickle"]))\n'
        '        if "json" not in sd or not isinstance(sd["json"], str):\n',
        ("tests/test_checkpoint_step.py::test_json_state_round_trips_and_never_unpickles",
         "tests/test_checkpoint_trust.py::test_json_state_loads_data_and_never_unpickles"),
    ),
    Mutant.at(
        "stored_values_not_weights_only",
        "DCP's non-tensor values load with torch.load(weights_only=False)",
        "torchllm.checkpoint.index:load_value",
        "            return torch.load(io.BytesIO(data), map_location=\"cpu\", weights_only=True)",
        "            return torch.load(io.BytesIO(data), map_location=\"cpu\", weights_only=False)",
        ("tests/test_checkpoint_trust.py::test_stored_values_load_as_data_only",),
    ),
    Mutant.at(
        "reader_uses_dcps_planner",
        "a Step loads with DCP's default planner (its stored values unpickled with "
        "weights_only=False)",
        "torchllm.checkpoint.step:Step.read",
        "        dcp.load(state_dict, storage_reader=reader, planner=DataPlanner(reader), "
        "no_dist=no_dist)",
        "        dcp.load(state_dict, storage_reader=reader, no_dist=no_dist)",
        ("tests/test_checkpoint_trust.py::test_dcp_reads_of_poisoned_values_are_refused_naming_the_file",),
    ),
    Mutant.at(
        "index_read_outside_the_step",
        "a recorded chunk path is joined to the step folder unchecked (`../` reads another "
        "run's weights)",
        "torchllm.checkpoint.index:check_reads",
        '        if name in ("", ".", "..") or "/" in name or "\\\\" in name or name not in sizes \\\n'
        "                or name == INDEX:\n",
        "        if False:\n",
        ("tests/test_checkpoint_step.py::test_an_index_reading_outside_the_step_is_refused_before_any_tensor",),
    ),
    Mutant.at(
        "index_lengths_trusted",
        "a recorded (offset, length) is read without checking it against the file's recorded "
        "size (a 3 GB length reads 3 GB)",
        "torchllm.checkpoint.index:check_reads",
        "        if at < 0 or length < 0 or at + length > sizes[name]:\n",
        "        if at < 0 or length < 0:\n",
        ("tests/test_checkpoint_step.py::test_an_over_long_read_is_refused_before_reading",),
    ),
    Mutant.at(
        "index_file_not_in_complete",
        "the index may read a file COMPLETE does not list (its CRC never checked)",
        "torchllm.checkpoint.layout:recorded_sizes",
        "    files = marker.get(\"files\")\n    if not files:\n",
        "    files = None\n    if not files:\n",
        ("tests/test_checkpoint_step.py::test_an_over_long_read_is_refused_before_reading",),
    ),
    Mutant.at(
        "checkpoint_config_imports_code",
        "a checkpoint's config.toml is loaded like the user's own: its job.custom_import runs "
        "code in generate, the evals and hf export",
        "torchllm.config.loader:load_config",
        "                if not file_runs_code and (section, key) in CODE_KEYS:\n",
        "                if False:\n",
        ("tests/test_checkpoint_step.py::test_a_downloaded_checkpoint_config_never_imports_code",),
    ),
    Mutant.at(
        "inference_skips_checksums",
        "generate, the evals and convert read a checkpoint without its COMPLETE CRC-32s",
        "torchllm.checkpoint.step:open_checkpoint",
        "    problem = step.verify()\n",
        "    problem = None\n",
        ("tests/test_checkpoint_trust.py::test_convert_and_inference_loading_refuse_a_flipped_byte_or_code",),
    ),
    Mutant.at(
        "resume_falls_back_from_untrusted",
        "a resume treats a value that would run code as a read error and falls back",
        "torchllm.checkpoint.resume.restore:Restore.restore",
        "            problem, misfit = describe_failure(e), untrusted_cause(e)  # code in it: stop",
        "            problem, misfit = describe_failure(e), None",
        ("tests/test_checkpoint_trust.py::"
         "test_run_train_sh_resume_refuses_a_checkpoint_that_runs_code[pickled_state]",),
    ),
    Mutant.at(
        "new_vocab_rows_all_the_mean",
        "new token rows all start equal to the mean row (transformers draws them around it)",
        "torchllm.checkpoint.stage.vocab_resize:grow_rows",
        "    if int(info) == 0:  # positive definite",
        "    if False:  # positive definite",
        ("tests/test_vocab_rows.py::test_new_rows_are_drawn_as_transformers_draws_them",),
    ),
    Mutant.at(
        "new_vocab_rows_full_covariance",
        "new token rows drawn with the old rows' full covariance (transformers scales it by 1e-9)",
        "torchllm.checkpoint.stage.vocab_resize:grow_rows",
        "    covariance = 1e-9 * (centered.T @ centered / saved_vocab)",
        "    covariance = centered.T @ centered / saved_vocab",
        ("tests/test_vocab_rows.py::test_new_rows_are_drawn_as_transformers_draws_them",),
    ),
    Mutant.at(
        "store_error_before_save_uncaught",
        "a store error clearing the step before a save (botocore's, no OSError) escapes "
        "checkpoint.on_save_error as a traceback",
        "torchllm.checkpoint.resume.saver:Saver.save",
        "            except Exception as e:  # noqa: BLE001 - any store error (botocore's are no "
        "OSError)\n",
        "            except OSError as e:\n",
        ("tests/test_store_errors.py::test_a_refusing_store_is_a_save_error_not_a_traceback",),
    ),
    Mutant.at(
        "store_timeout_not_applied",
        "checkpoint.store_timeout_s is never handed to the object-store client (a stalled store "
        "blocks a save for many minutes)",
        "torchllm.checkpoint.resume.checkpointer:Checkpointer.__init__",
        "        set_store_timeout(ccfg.store_timeout_s)\n",
        "",
        ("tests/test_store_errors.py::"
         "test_a_stalled_store_fails_the_save_in_time_and_continue_keeps_training",),
    ),
    Mutant.at(
        "disk_full_short_write_unrecognised",
        "torch.save's short write on a full disk ('unexpected pos') is not recognised as a full "
        "disk",
        "torchllm.checkpoint.integrity:is_disk_full",
        '        if "unexpected pos" in str(x) or "No space left on device" in str(x):',
        '        if False:',
        ("tests/test_store_errors.py::"
         "test_torch_saves_errno_less_short_write_counts_as_a_full_disk",),
    ),
    Mutant.at(
        "no_room_check_at_launch",
        "a launch on a disk without room for one save trains until its first save",
        "torchllm.checkpoint.resume.checkpointer:Checkpointer.__init__",
        "            self._check_room(model, optimizer)\n",
        "            pass\n",
        ("tests/test_store_errors.py::test_a_launch_on_a_full_disk_is_refused_before_step_1",),
    ),
    Mutant.at(
        "retention_counts_unhealthy_steps",
        "retention counts steps saved while the guard skipped updates: a bad stretch evicts the "
        "last good checkpoint",
        "torchllm.checkpoint.resume.retention:Retention.purge",
        "        good = [s for s in known if s not in self.not_resumable]\n",
        "        good = list(known)\n",
        ("tests/test_resume_trust.py::test_bad_stretch_keeps_the_last_good_checkpoint_and_a_relaunch_resumes_it",),
    ),
    Mutant.at(
        "weights_only_resumed_as_full_state",
        "a resume takes the newest complete step even when it holds weights only",
        "torchllm.checkpoint.resume.loading:Resume._candidates",
        "        good = [s for s in steps if s not in skip or s == 0]\n",
        "        good = list(steps)\n",
        ("tests/test_resume_trust.py::test_weights_only_final_save_is_passed_over_for_the_full_state",),
    ),
    Mutant.at(
        "resumed_lr_from_old_schedule",
        "the first resumed step's LR is the one the checkpoint's schedule set (training.steps "
        "changed), not this config's",
        "torchllm.checkpoint.resume.restore:Restore.after_resume",
        "            current_lr(self.optimizer, self.lr_scheduler)\n",
        "            pass\n",
        ("tests/test_resume_trust.py::test_weights_only_final_save_is_passed_over_for_the_full_state",),
    ),
    Mutant.at(
        "data_restart_keeps_position",
        "on_data_change = 'restart' says so but still loads the old data position",
        "torchllm.data.fingerprint:data_fit",
        '    fit.exclude = [*fit.exclude, "dataloader"]\n',
        "    fit.exclude = fit.exclude\n",
        ("tests/test_resume_trust.py::test_resume_with_changed_data_says_what_changed_and_restarts_or_refuses[seq_len]",),
    ),
    Mutant.at(
        "tokenizer_identity_by_size", "another tokenizer of the same size passes (the SHA-256 "
        "is not compared)", "torchllm.checkpoint.stage.tokenizer_identity:check_same_tokenizer",
        "    if a and b:\n        same = a == b\n", "    if a and b:\n        same = True\n",
        ("tests/test_stage_tokenizer.py::"
         "test_resuming_with_another_tokenizer_of_the_same_size_names_both",
         "tests/test_stage_tokenizer.py::"
         "test_generate_never_trains_a_missing_tokenizer_nor_takes_another"),
    ),
    Mutant.at(
        "stage_train_choice_refused", "data.tokenizer = 'train' at a stage is refused like any "
        "other tokenizer (no way to choose a new one)",
        "torchllm.checkpoint.stage.tokenizer_identity:check_same_tokenizer",
        '    if use == "initial load" and now.get("new"):\n', "    if False:\n",
        ("tests/test_stage_tokenizer.py::"
         "test_a_stage_on_new_data_keeps_its_checkpoints_tokenizer",),
    ),
    Mutant.at(
        "hf_stage_reads_tokenizer_json_only", "a Hugging Face folder's tokenizer.model (a "
        "SentencePiece export) is not its tokenizer",
        "torchllm.checkpoint.stage.tokenizer_identity:HF_TOKENIZER_FILES",
        'HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")\n',
        'HF_TOKENIZER_FILES = ("tokenizer.json",)\n',
        ("tests/test_stage_tokenizer.py::"
         "test_a_stage_from_a_hugging_face_export_keeps_its_tokenizer",),
    ),
    Mutant.at(
        "inference_reads_unhealthy_newest", "generate / export of a run read the step saved while updates were skipped",
        "torchllm.checkpoint.layout:resolve_checkpoint",
        "            return folder.newest_healthy(steps)",
        "            return folder.step_path(steps[-1])",
        ("tests/test_resume_trust.py::test_bad_stretch_keeps_the_last_good_checkpoint_and_a_relaunch_resumes_it",),
    ),
    Mutant.at(
        "storage_resolved_per_call", "storage_for makes a new file system (and checks the "
        "protocol's package) on every call instead of once per protocol",
        "torchllm.storage:_storage_of",
        "@lru_cache(maxsize=None)\ndef _storage_of(",
        "def _storage_of(",
        ("tests/test_storage_leaf.py::test_each_protocol_is_resolved_once",),
    ),
    Mutant.at(
        "resume_hparams_from_a_table", "a resume says which optimizer keys the checkpoint keeps "
        "from a fixed (AdamW + Muon) table instead of the run's OptimizerSpec",
        "torchllm.checkpoint.resume.hparams:config_changes",
        '    hparams = resume_hparams(*{str(c.get("optimizer.name", "adamw")) for c in (old, new)})\n',
        '    hparams = {"optimizer." + k for k in ("lr", "beta1", "beta2", "eps", "weight_decay",\n'
        '                                          "muon_lr", "muon_momentum")}\n',
        ("tests/test_optimizer_plugin.py::"
         "test_toy_optimizer_trains_and_resumes_exactly_through_the_trainer",),
    ),
    # file, store errors under on_save_error = 'stop' ---
    Mutant.at(
        "dcp_initial_load_tokenizer_unchecked", "a stage from a DCP checkpoint (initial_load_path) "
        "accepts another tokenizer of the same size: only a resume compares the SHA-256",
        "torchllm.checkpoint.stage.vocab_resize:plan_growth",
        '    check_same_tokenizer(saved, now, f"checkpoint {path}", "resume" if resume else '
        '"initial load")\n',
        '    if resume:\n        check_same_tokenizer(saved, now, f"checkpoint {path}", "resume")\n',
        ("tests/test_stage_tokenizer.py::test_a_stage_from_a_dcp_checkpoint_with_another_"
         "tokenizer_of_the_same_size_names_both",),
    ),
    Mutant.at(
        "hub_name_against_file_passes", "a tokenizer by Hub name against one by file passes "
        "unchecked (no SHA-256 on one side)", "torchllm.checkpoint.stage.tokenizer_identity:check_same_tokenizer",
        "        same = digest == (a or b)\n",
        "        same = True\n",
        ("tests/test_stage_tokenizer.py::test_a_hub_name_against_a_file_is_compared_by_the_"
         "cached_copy_or_refused",),
    ),
    Mutant.at(
        "disk_full_not_recognised", "a save failing on a full disk (ENOSPC from DCP's writer) "
        "is reported as a generic I/O error, without 'no space left on' and the bytes needed",
        "torchllm.checkpoint.integrity:is_disk_full",
        "    seen, todo = set(), [e]\n",
        "    seen, todo = set(), []\n",
        ("tests/test_store_errors.py::test_a_disk_that_fills_during_a_save_is_named",),
    ),
    Mutant.at(
        "lora_resume_optimizer_not_restored",
        "a resume loads the weights but not the optimizer state (the adapters' AdamW moments)",
        "torchllm.checkpoint.resume.loading:Resume.pick",
        "                                         self.cfg.exclude_from_loading, resume=True)",
        "                                         [*self.cfg.exclude_from_loading, "
        "\"optimizer\"],\n                                         resume=True)",
        ("tests/test_lora.py::test_shipped_config_trains_adapters_only_resumes_exactly_and_exports",),
    ),
    Mutant.at(
        "lora_resume_adam_step_behind",
        "a resume restores the optimizer's moments with the step counters of the step before",
        "torchllm.checkpoint.state:OptimizerState.load_state_dict",
        "        set_optimizer_state_dict(self.model, self.optimizer, sd)",
        "        for s in sd.get(\"state\", {}).values():\n"
        "            s[\"step\"] = s[\"step\"] - 1\n"
        "        set_optimizer_state_dict(self.model, self.optimizer, sd)",
        ("tests/test_lora.py::test_shipped_config_trains_adapters_only_resumes_exactly_and_exports",),
    ),
    Mutant.at(
        "checkpoint_folder_file_url_allowed",
        "checkpoint.folder = 'file:///.../other_run/checkpoint' passes the path rule (a URL)",
        "torchllm.config.paths:path_errors",
        "            if problem := local_url(value) or missing_package(value):",
        "            if problem := missing_package(value):",
        (IDENTITY + "test_a_file_url_to_another_runs_folder_is_refused_before_anything_runs",),
    ),
    Mutant.at(
        "another_runs_steps_claimed",
        "a checkpoint folder holding another run's steps is resumed, written into and pruned",
        "torchllm.checkpoint.identity:foreign",
        "        if other is not None and other != mine:",
        "        if False:",
        (IDENTITY + "test_a_shared_bucket_prefix_is_never_resumed_written_or_pruned_by_another_run",
         IDENTITY + "test_steps_of_another_run_copied_into_a_runs_own_folder_are_refused_in_process"),
    ),
    Mutant.at(
        "nonfinite_by_float32_sum",
        "the before-save NaN check sums in float32: finite 1000 x 1e36 marks a step NONFINITE",
        "torchllm.checkpoint.integrity:_all_finite",
        "    return torch.isfinite(t).all()\n",
        "    return torch.sum(t, dtype=torch.float32).isfinite()\n",
        ("tests/test_nonfinite_check.py::test_finite_values_whose_sum_overflows_are_saved_complete",),
    ),
    Mutant.at(
        "nonfinite_skips_tensor_subclasses",
        "the before-save NaN check skips torchao's 8-bit optimizer states",
        "torchllm.checkpoint.integrity:_all_finite",
        "        names, _ = t.__tensor_flatten__()\n",
        "        return None\n",
        ("tests/test_nonfinite_check.py::test_nonfinite_in_a_torchao_8bit_optimizer_state_is_counted[scale]",
         "tests/test_nonfinite_check.py::test_nonfinite_in_a_torchao_8bit_optimizer_state_is_counted[qmap]"),
    ),
    Mutant.at(
        "overwrite_keeps_bucket_steps",
        "--job.overwrite over a run whose checkpoints are on a bucket deletes none of its steps: "
        "the relaunch resumes them instead of starting afresh",
        "torchllm.checkpoint.resume.retention:Retention.clear",
        "        if not problem and steps:\n",
        "        if False:\n",
        ("tests/test_object_storage.py::"
         "test_overwrite_deletes_this_runs_steps_on_a_bucket_and_starts_afresh",),
    ),
]
