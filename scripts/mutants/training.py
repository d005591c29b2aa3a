"""Mutants of the training step: optimizers, loss, precision, the Trainer (scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

MUTANTS = [
    Mutant.at(
        "wait_for_staging_removed", "the optimizer steps while an async save is still staging",
        "torchllm.train:Trainer.train_step",
        "            self.checkpointer.wait_for_staging()  # an async save must copy the weights first\n",
        "",
        ("tests/test_checkpoint.py::test_async_save_equals_sync_save",),
    ),
    Mutant.at(
        "clipping_ignored", "the Trainer never clips (max_norm ignored)",
        "torchllm.train_module:TrainModule.clip_grads",
        "return clip_grad_norm_(self.model.parameters(), self.tcfg.max_norm,",
        "return clip_grad_norm_(self.model.parameters(), 0.0,",
        ("tests/test_train.py::test_matches_plain_pytorch_reference_loop",),
    ),
    Mutant.at(
        "loss_upcast_removed",
        "the trainer's (fused) cross entropy takes a bf16 log-sum-exp of bf16 logits",
        "torchllm.loss:_FusedCrossEntropy.forward",
        "lse[start:start + rows] = torch.logsumexp(logits[start:start + rows].float(), dim=-1)",
        "lse[start:start + rows] = torch.logsumexp(logits[start:start + rows], dim=-1)",
        ("tests/test_speed_paths.py::test_fused_cross_entropy_equals_float32_cross_entropy",),
    ),
    Mutant.at(
        "chunked_loss_upcast_removed",
        "the chunked loss's forward keeps bf16 logits (FSDP2 bf16 params: no autocast to upcast)",
        "torchllm.loss:_ChunkedCrossEntropy.forward",
        "logits = F.linear(hidden[start : start + chunk], weight).float()",
        "logits = F.linear(hidden[start : start + chunk], weight)",
        ("tests/test_recipes.py::test_chunked_cross_entropy_of_bf16_inputs_is_computed_in_float32",),
    ),
    Mutant.at(
        "chunked_loss_ignore_mask_wrong", "the chunked loss's backward ignores the ignore mask",
        "torchllm.loss:_ChunkedCrossEntropy.backward",
        "                dlogits.mul_(valid)\n",
        "",
        ("tests/test_recipes.py::test_chunked_loss_in_model_equals_plain",),
    ),
    Mutant.at(
        "loss_normalized_per_micro_batch",
        "each micro-batch's loss is divided by its own token count (mean of means)",
        "torchllm.train_module:TrainModule.train_batch",
        "(total * (self.dp_degree * self.cp.degree / global_tokens)).backward()",
        "(total * (self.dp_degree * self.cp.degree / (targets != IGNORE_INDEX).sum()"
        " / len(micro_batches))).backward()",
        ("tests/test_train.py::test_loss_is_normalized_by_the_global_count_of_non_ignored_targets",),
    ),
    Mutant.at(
        "loader_workers_left_running", "Trainer.close leaves the data loader's workers running",
        "torchllm.train:Trainer.close", "        self.train_loader.close(self.batches)\n", "",
        ("tests/test_data.py::test_train_stops_its_loader_workers",),
    ),
    Mutant.at(
        "precision_per_rank", "each rank keeps its own auto-precision verdict (no vote)",
        "torchllm.precision:cpu_native_bf16", "    agreed, split = _agree(native)\n",
        "    agreed, split = native, False\n",
        ("tests/test_precision.py::test_auto_precision_is_the_same_on_every_rank",),
    ),
    Mutant.at(
        "training_lines_on_stderr", "the trainer's INFO lines go to stderr, not stdout",
        "torchllm.log:init_logger", "        out = logging.StreamHandler(sys.stdout)\n",
        "        out = logging.StreamHandler(sys.stderr)\n",
        ("tests/test_report.py::test_train_log_stdout_stderr_and_the_end_block",),
    ),
    Mutant.at(
        "run_log_overwritten", "a resumed launch overwrites train.log instead of appending",
        "torchllm.log:RunLogHandler.open", 'open(Path(run_dir) / RUN_LOG, "a", encoding="utf-8")',
        'open(Path(run_dir) / RUN_LOG, "w", encoding="utf-8")',
        ("tests/test_report.py::test_train_log_stdout_stderr_and_the_end_block",),
    ),
    Mutant.at(
        "failed_build_keeps_state", "a Trainer that fails to build keeps deterministic kernels "
        "and its run lock (the next Trainer in the process inherits both)",
        "torchllm.train:Trainer.__init__",
        "            if self.run_lock is not None:\n                self.run_lock.release()\n"
        "            restore_determinism(self.determinism)\n            raise",
        "            raise",
        ("tests/test_run_safety.py::test_a_trainer_that_fails_to_build_gives_back_what_it_took",),
    ),
    Mutant.at(
        "loss_size_rule_ignored",
        "bf16 logits always take the chunked cross entropy, however small (the size rule lost)",
        "torchllm.loss:plain_kernels",
        "    return 4 * logits_numel <= _PLAIN_MAX_BYTES",
        "    return False",
        ("tests/test_speed_paths.py::test_fused_cross_entropy_equals_float32_cross_entropy",),
    ),
    Mutant.at(
        "golden_warmup_off_by_one",
        "the LR schedule is evaluated at the completed-step count: step 1 runs at LR 0",
        "torchllm.optim.lr_schedule:build_lr_scheduler",
        "lambda done: factor(done + 1) * scale(done + 1)",
        "lambda done: factor(done) * scale(done + 1)",
        ("tests/test_golden_curves.py::test_single_process_curve[llama]",),
    ),
    Mutant.at(
        "hub_probe_skipped", "a Hub lookup offline waits through huggingface_hub's retries",
        "torchllm.hub:prepare_hub",
        "    if not hub_reachable():\n        set_offline()\n        return True\n    return False",
        "    return False",
        ("tests/test_fresh_clone.py::test_hub_config_fails_offline_in_one_line[llama3_1b]",),
    ),
    Mutant.at(
        "gpu_harness_teacher_forcing_off",
        "the oracle's path under test keeps its own weights instead of the reference's per step",
        "tests.gpu_harness:load_step_state",
        "            _local(p).copy_(record.weights[name].to(_local(p).dtype))",
        "            pass",
        ("tests/test_gpu_harness.py::test_teacher_forced_oracle_passes_rounding_and_fails_a_compiled_rope_bug",),
    ),
    Mutant.at(
        "gpu_test_leaves_matmul_precision", "a GPU test's TF32 switch outlives it ('highest' -> 'high')",
        "tests.gpu_harness:restored_process_state",
        "        torch.set_float32_matmul_precision(precision)  # after allow_tf32: it sets this too",
        "        pass",
        ("tests/test_gpu_harness.py::test_restored_process_state_undoes_what_cuda_paths_change",),
    ),
    Mutant.at(
        "gpu_skip_by_keyword", "tests skip when any keyword (a folder's name) is 'gpu', not only marked ones",
        "tests.conftest:pytest_collection_modifyitems",
        '        if item.get_closest_marker("gpu"):',
        '        if "gpu" in item.keywords:',
        ("tests/test_gpu_harness.py::test_only_tests_marked_gpu_skip_without_cuda",),
    ),
    Mutant.at(
        "optimizer_registry_builds_adamw", "the trainer builds AdamW whatever optimizer.name "
        "names (the registry looked up, its builder not used)",
        "torchllm.optim.registry:build_optimizer",
        "    return get(ocfg.name).build(model, ocfg, device)",
        "    return get(ocfg.name) and get(\"adamw\").build(model, ocfg, device)",
        ("tests/test_optimizer_plugin.py::"
         "test_toy_optimizer_trains_and_resumes_exactly_through_the_trainer",),
    ),
    Mutant.at(
        "muon_ns_always_bf16", "Muon orthogonalizes in bf16 on CPUs without native bf16 (~20x slower)",
        "torchllm.optim.muon:muon",
        "             ns_dtype=fast_ns_dtype(device)),",
        "             ns_dtype=torch.bfloat16),",
        ("tests/test_muon_ns_dtype.py::test_trainer_runs_newton_schulz_in_float32_on_a_cpu_without_native_bf16",),
    ),
    Mutant.at(
        "muon_ns_dtype_ignored", "the Newton-Schulz iteration runs in bf16 whatever ns_dtype says",
        "torchllm.optim.muon_ns:newton_schulz",
        "    x = grad.to(dtype)\n",
        "    x = grad.to(torch.bfloat16)\n",
        ("tests/test_muon_ns_dtype.py::test_muon_matches_torch_in_bf16_and_float32_within_bf16_rounding",),
    ),
    Mutant.at(
        "hub_offline_imports_datasets", "going offline imports datasets (~4 s) for its switch",
        "torchllm.hub:set_offline",
        "    datasets_config = sys.modules.get(\"datasets.config\")",
        "    import datasets.config as datasets_config",
        ("tests/test_offline.py::test_hub_offline_switch_does_not_import_datasets",),
    ),
    Mutant.at(
        "sft_tokens_seen_count_padding", "an SFT run's tokens seen (and tok/s, MFU) count the "
        "packing's padding as processed tokens", "torchllm.data.packing.chat:processed_tokens",
        "    if packed_chat and \"positions\" in batch:",
        "    if False:",
        ("tests/test_chat_isolation.py::"
         "test_run_train_sh_sft_config_loss_is_transformers_loss_of_each_conversation_alone",),
    ),
]
