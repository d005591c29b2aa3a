"""Mutants of model families, attention, MoE, LoRA (scripts/mutation_check.py runs them).

Each names the definition its bug lives in (`Mutant.at("module:Qual.name", ...)`, base.py): the
snippet is looked for in that function, method, class or assignment only, wherever it sits."""

from __future__ import annotations

from mutants.base import Mutant

MUTANTS = [
    Mutant.at(
        "rope_interpolation_wrong", "Llama 3.1 RoPE scaling: the smooth factor runs backwards",
        "torchllm.models.llama.model:rope_frequencies",
        "interpolated = (1 - smooth) * inv_freq / args.rope_scaling_factor + smooth * inv_freq",
        "interpolated = smooth * inv_freq / args.rope_scaling_factor + (1 - smooth) * inv_freq",
        ("tests/test_model.py::test_rope_scaling_matches_the_llama31_reference_formula",),
    ),
    Mutant.at(
        "dropout_in_eval", "dropout stays on in eval mode (validation, generation)",
        "torchllm.models.llama.model:Attention.forward",
        "        p = self.dropout if self.training and cache is None else 0.0",
        "        p = self.dropout if cache is None else 0.0",
        ("tests/test_model.py::test_dropout_is_training_only_and_follows_the_seed",),
    ),
    Mutant.at(
        "shape_keys_ignored", "the [model] shape keys are checked but never applied",
        "torchllm.models.registry:build_args", "        return dataclasses.replace(args, **changes, **shape)\n",
        "        return dataclasses.replace(args, **changes)\n",
        ("tests/test_model_shapes.py::"
         "test_gpt2_4x128_and_llama_20_layers_match_a_by_hand_count",),
    ),
    Mutant.at(
        "moe_capacity_exact", "MoE's padded path uses the exact capacity: a new matmul shape "
        "almost every step (oneDNN caches one kernel per shape: RSS grows)",
        "torchllm.models.moe:GroupedExperts._padded",
        "        capacity = max(load, 1) if torch.compiler.is_compiling() else padded_capacity(load)\n",
        "        capacity = max(load, 1)\n",
        ("tests/test_moe_memory.py::"
         "test_rss_stays_flat_over_many_steps[qwen3_moe-extra0]",),
    ),
    Mutant.at(
        "compiled_rope_backward_sign",
        "the compiled bf16 RoPE's own backward rotates by +angle (the forward's direction)",
        "torchllm.models.llama.model:_RotatePairs.backward",
        "        return _rotate_pairs(grad, cos, -sin), None, None",
        "        return _rotate_pairs(grad, cos, sin), None, None",
        ("tests/test_speed_paths.py::test_rope_equals_the_written_out_rotation",),
    ),
    Mutant.at(
        "golden_init_std", "Llama's linear layers initialized with std 1/sqrt(fan_out), not fan_in",
        "torchllm.models.llama.model:_init_linear",
        "std = scale / math.sqrt(linear.in_features)",
        "std = scale / math.sqrt(linear.out_features)",
        ("tests/test_golden_curves.py::test_single_process_curve[llama]",),
    ),
    Mutant.at(
        "golden_rope_theta_default", "Llama's default RoPE base frequency is 10000 (Llama 2's)",
        "torchllm.models.llama.args:LlamaArgs",
        "    rope_theta: float = 500000.0\n",
        "    rope_theta: float = 10000.0\n",
        ("tests/test_golden_curves.py::test_single_process_curve[llama]",),
    ),
    Mutant.at(
        "lora_b_random_init", "LoRA's B starts random (step 0 is no longer the base model)",
        "torchllm.models.lora:LoRALinear.reset_lora_parameters",
        "        nn.init.zeros_(self.lora_B.weight)",
        "        nn.init.normal_(self.lora_B.weight, std=0.02)",
        ("tests/test_lora.py::test_adapters_start_as_the_base_model_with_peft_init",),
    ),
    Mutant.at(
        "lora_base_not_frozen", "LoRA freezes only the wrapped linears (norms, embeddings train)",
        "torchllm.models.lora:apply_lora",
        "    for p in model.parameters():\n        p.requires_grad_(False)\n",
        "",
        ("tests/test_lora.py::test_adapters_start_as_the_base_model_with_peft_init",),
    ),
    Mutant.at(
        "lora_scaling_alpha_only", "LoRA's update is scaled by alpha, not alpha / rank",
        "torchllm.models.lora:LoRALinear.__init__",
        "        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank",
        "        self.rank, self.alpha, self.scaling = rank, alpha, alpha",
        ("tests/test_lora.py::test_adapter_and_merged_exports_give_torchllm_logits[llama3]",),
    ),
    Mutant.at(
        "lora_merge_without_scaling", "the merged export adds B @ A without alpha / rank",
        "torchllm.models.lora:merge_weights",
        "        out[f\"{name}.weight\"] = (w.float() + scaling * (b @ a)).to(w.dtype)",
        "        out[f\"{name}.weight\"] = (w.float() + b @ a).to(w.dtype)",
        ("tests/test_lora.py::test_adapter_and_merged_exports_give_torchllm_logits[llama3]",),
    ),
    Mutant.at(
        "lora_initial_load_needs_adapters",
        "a LoRA run's initial load requires the adapters in the base checkpoint",
        "torchllm.models.lora:fresh_adapters",
        "    if resume or \"model\" not in sds:\n        return {}",
        "    if True:\n        return {}",
        ("tests/test_lora.py::test_adapter_and_merged_exports_give_torchllm_logits[llama3]",),
    ),
    Mutant.at(
        "compiled_rope_rotates_backwards",
        "RoPE's compiled branch (what inductor runs on a GPU) rotates by -angle; eager is right",
        "torchllm.models.llama.model:_rotate_pairs",
        "    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).type_as(x)",
        "    return torch.stack((x0 * cos + x1 * sin, -x0 * sin + x1 * cos), dim=-1).flatten(-2).type_as(x)",
        ("tests/test_gpu_harness.py::test_teacher_forced_oracle_passes_rounding_and_fails_a_compiled_rope_bug",),
    ),
    Mutant.at(
        "qwen3_tp_plan_drops_qk_norm", "Qwen3's declared TP plan forgets the QK-norm style",
        "torchllm.models.qwen3.plan:TP_PLAN",
        "    block={**ATTENTION, **SWIGLU, **QK_NORM},",
        "    block={**ATTENTION, **SWIGLU},",
        ("tests/test_parallel_multiprocess.py::test_qk_norm_weights_replicated_over_tp",),
    ),
    Mutant.at(
        "qwen3_spec_forgets_qk_norm", "Qwen3's ModelSpec does not declare QK-norm: the memory "
        "estimate counts a Llama attention's activations for it",
        "torchllm.models.qwen3:SPEC",
        "pipeline=PIPELINE, qk_norm=True,\n",
        "pipeline=PIPELINE,\n",
        ("tests/test_estimate_memory.py::"
         "test_estimate_within_5_percent_of_measured_on_debug[qwen3_qk_norm]",),
    ),
    Mutant.at(
        "lora_header_total_counts_frozen_only",
        "the run header's 'of N params' counts the frozen base only (not base + adapters)",
        "torchllm.models.lora:parameter_summary",
        "    total = sum(p.numel() for p in model.parameters())",
        "    total = sum(p.numel() for p in model.parameters() if not p.requires_grad)",
        ("tests/test_lora.py::test_shipped_config_trains_adapters_only_resumes_exactly_and_exports",),
    ),
    Mutant.at(
        "lora_resume_mismatch_ignores_train_embeddings",
        "a resume with another lora.train_embeddings is not named (a generic shape error)",
        "torchllm.models.lora:_lora_keys",
        "           for k in (\"enable\", \"rank\", \"target_modules\", \"train_embeddings\", \"train_new_tokens\")}",
        "           for k in (\"enable\", \"rank\", \"target_modules\", \"train_new_tokens\")}",
        ("tests/test_lora.py::test_resume_with_other_lora_settings_is_one_line_naming_the_key",),
    ),
    Mutant.at(
        "lora_resume_mismatch_off",
        "a resume under other [lora] settings never names the key (resume_mismatch finds nothing)",
        "torchllm.models.lora:resume_mismatch",
        "    if not old[\"lora.enable\"] and not new[\"lora.enable\"]:\n        return None",
        "    if True:\n        return None",
        ("tests/test_lora.py::test_resume_with_other_lora_settings_is_one_line_naming_the_key",),
    ),
    Mutant.at(
        "lora_tp_not_refused", "LoRA with tensor parallelism is not refused at the launcher",
        "torchllm.models.lora:check_lora",
        "            (\"parallelism.tensor_parallel_degree\", dims.tp_enabled,",
        "            (\"parallelism.tensor_parallel_degree\", False,",
        ("tests/test_lora.py::test_lora_with_tp_pp_or_float8_stops_at_the_launcher[tp]",),
    ),
    Mutant.at(
        "lora_pp_not_refused", "LoRA with pipeline parallelism is not refused at the launcher",
        "torchllm.models.lora:check_lora",
        "            (\"parallelism.pipeline_parallel_degree\", dims.pp_enabled,",
        "            (\"parallelism.pipeline_parallel_degree\", False,",
        ("tests/test_lora.py::test_lora_with_tp_pp_or_float8_stops_at_the_launcher[pp]",),
    ),
    Mutant.at(
        "lora_float8_not_refused", "LoRA with float8 is not refused at the launcher",
        "torchllm.models.lora:check_lora",
        "    refused = [(\"float8.enable\", float8,",
        "    refused = [(\"float8.enable\", False,",
        ("tests/test_lora.py::test_lora_with_tp_pp_or_float8_stops_at_the_launcher[float8]",),
    ),
    Mutant.at(
        "contract_not_checked_at_build",
        "a family's model that lacks a member of the model contract builds (it fails later, deep "
        "in a parallel plan or the exporter, with an AttributeError)",
        "torchllm.models.spec:ModelSpec.build",
        "return check_model(self.model_cls(args), self.name)",
        "return self.model_cls(args)",
        ("tests/test_model_contract.py::test_a_family_that_drops_a_member_is_refused_naming_it",),
    ),
    Mutant.at(
        "kv_gather_only_on_the_model",
        "context parallelism's gather reaches the mask's key indices but not the attentions",
        "torchllm.models.llama.model:Transformer.set_kv_gather",
        "            block.attention.kv_gather = gather\n",
        "            pass\n",
        ("tests/test_model_contract.py::"
         "test_every_registered_family_satisfies_the_contract_with_its_shapes",),
    ),
    Mutant.at(
        "lora_new_token_rows_frozen_by_default",
        "LoRA keeps the rows of the chat tokens it grows frozen unless asked (it cannot learn "
        "to end a reply)",
        "torchllm.config.sections:Lora.train_new_tokens",
        "        True, \"When the run's tokenizer adds chat tokens to its base",
        "        False, \"When the run's tokenizer adds chat tokens to its base",
        ("tests/test_lora_tokens.py::"
         "test_new_token_rows_train_and_the_run_learns_to_end_its_replies",),
    ),
    Mutant.at(
        "lora_token_rows_not_in_head",
        "the output head ignores its trainable token rows (logits without them)",
        "torchllm.models.head:lm_head",
        "    if getattr(output, \"token_delta\", None) is not None:\n"
        "        return F.linear(h, rows_added(output.weight, output), output.bias)\n",
        "",
        ("tests/test_lora_tokens.py::"
         "test_only_the_added_rows_change_and_every_other_weight_is_bit_identical",),
    ),
    Mutant.at(
        "lora_token_rows_not_merged",
        "the merged export drops the trained token rows",
        "torchllm.models.lora:merge_weights",
        "        w[ids[0]: ids[-1] + 1] += sd[key].to(w.dtype)\n",
        "",
        ("tests/test_lora_tokens.py::"
         "test_adapter_export_loads_in_peft_on_its_base_and_on_the_base_run_resized",),
    ),
    Mutant.at(
        "lora_moe_bias_updated",
        "LoRA on qwen3_moe with moe_bias_update_rate > 0 moves the frozen base's expert_bias",
        "torchllm.metrics.moe_stats:MoEBiasBalancer.from_context",
        "        if ctx.cfg.lora.enable:  # the routing biases",
        "        if False:  # the routing biases",
        ("tests/test_moe_balancing.py::"
         "test_lora_leaves_the_routing_biases_of_the_frozen_base_bit_identical",),
    ),
    Mutant.at(
        "other_family_over_a_checkpoint",
        "--model.name of another family in generate / eval / export is a raw KeyError traceback",
        "torchllm.models.registry:check_family",
        "    if name != saved:\n",
        "    if False:\n",
        ("tests/test_unclear_errors.py::test_another_family_over_a_checkpoint_is_one_line[qwen3]",),
    ),
    Mutant.at(
        "lora_initial_load_advises_itself",
        "LoRA of another rank from a LoRA checkpoint advises checkpoint.initial_load_path, the "
        "command just run",
        "torchllm.models.lora:resume_mismatch",
        "            if resume:\n                advice =",
        "            if True:\n                advice =",
        ("tests/test_unclear_errors.py::test_lora_of_another_rank_from_a_lora_checkpoint_gets_other_advice",),
    ),
    Mutant.at(
        "lora_base_misfit_blames_lora",
        "LoRA from a base checkpoint of other shapes blames lora.enable instead of the shapes",
        "torchllm.models.lora:resume_mismatch",
        "    if not resume and not old[\"lora.enable\"]:",
        "    if False:",
        ("tests/test_unclear_errors.py::test_lora_from_a_base_checkpoint_that_does_not_fit_names_the_shapes",),
    ),
]
