"""Plant named bugs in a temporary copy of the repo and check that the tests that claim to catch
them go red.

    python scripts/mutation_check.py                 # every mutant; exit 1 if any survives
    python scripts/mutation_check.py --list          # names, files and the tests that guard them
    python scripts/mutation_check.py --only NAME     # one mutant (repeat --only for several)
    python scripts/mutation_check.py --check-patches # only check that every patch still applies

Each mutant is a text patch (an exact snippet of the source and its replacement) applied to a
copy of the working tree (tracked and untracked, not ignored files) in a temporary folder; its
tests then run there with PYTHONPATH pointing at the copy. A mutant "survives" when those tests
pass: the bug would ship green. A patch whose snippet is no longer in the source is reported as
stale (exit 2): update the snippet when the code it mutates changes. Run it before resolving an
issue that adds an oracle test, and add a mutant for the bug the new test guards against (see
tests/README.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # the realistic bug, in words
    path: str  # file to patch, relative to the repo root
    old: str  # exact snippet that must occur exactly once
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail

# The lines of RunLock._take_over between its two checks that the file is the stale one.
LOCK_LOG = """            logger.warning("taking over the stale lock %s of host %s pid %s: %s",
                           self.path, info.get("host"), info.get("pid"), reason)
"""
LOCK_ASIDE = """            aside = self.path.with_name(f"{LOCK_NAME}.stale.{os.getpid()}")
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                return False
"""

MUTANTS = [
    Mutant(
        "clipping_ignored", "the Trainer never clips (max_norm ignored)",
        "torchllm/train.py",
        'stats["grad_norm"] = clip_grad_norm_(self.model.parameters(), max_norm,',
        'stats["grad_norm"] = clip_grad_norm_(self.model.parameters(), 0.0,',
        ("tests/test_train.py::test_matches_plain_pytorch_reference_loop",),
    ),
    Mutant(
        "loss_upcast_removed",
        "the trainer's (fused) cross entropy takes a bf16 log-sum-exp of bf16 logits",
        "torchllm/loss.py",
        "lse[start:start + rows] = torch.logsumexp(logits[start:start + rows].float(), dim=-1)",
        "lse[start:start + rows] = torch.logsumexp(logits[start:start + rows], dim=-1)",
        ("tests/test_speed_paths.py::test_fused_cross_entropy_equals_float32_cross_entropy",),
    ),
    Mutant(
        "chunked_loss_upcast_removed",
        "the chunked loss's forward keeps bf16 logits (FSDP2 bf16 params: no autocast to upcast)",
        "torchllm/loss.py",
        "logits = F.linear(hidden[start : start + chunk], weight).float()",
        "logits = F.linear(hidden[start : start + chunk], weight)",
        ("tests/test_recipes.py::test_chunked_cross_entropy_of_bf16_inputs_is_computed_in_float32",),
    ),
    Mutant(
        "chunked_loss_ignore_mask_wrong", "the chunked loss's backward ignores the ignore mask",
        "torchllm/loss.py",
        "                dlogits.mul_(valid)\n",
        "",
        ("tests/test_recipes.py::test_chunked_loss_in_model_equals_plain",),
    ),
    Mutant(
        "loss_normalized_per_micro_batch",
        "each micro-batch's loss is divided by its own token count (mean of means)",
        "torchllm/train.py",
        "(total * (self.dp_degree * self.cp.degree / global_tokens)).backward()",
        "(total * (self.dp_degree * self.cp.degree / (targets != IGNORE_INDEX).sum()"
        " / len(micro_batches))).backward()",
        ("tests/test_train.py::test_loss_is_normalized_by_the_global_count_of_non_ignored_targets",),
    ),
    Mutant(
        "wait_for_staging_removed", "the optimizer steps while an async save is still staging",
        "torchllm/train.py",
        "            self.checkpointer.wait_for_staging()  # an async save must copy the weights first\n",
        "",
        ("tests/test_checkpoint.py::test_async_save_equals_sync_save",),
    ),
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
        "loader_draws_global_rng",
        "iter(train loader) draws its worker seed from the global torch RNG after a restore",
        "torchllm/data/loader.py",
        "                      generator=torch.Generator().manual_seed(0))",
        "                      )",
        ("tests/test_checkpoint.py::test_split_run_equals_straight_run_bit_for_bit",),
    ),
    Mutant(
        "rope_interpolation_wrong", "Llama 3.1 RoPE scaling: the smooth factor runs backwards",
        "torchllm/models/llama/model.py",
        "interpolated = (1 - smooth) * inv_freq / args.rope_scaling_factor + smooth * inv_freq",
        "interpolated = smooth * inv_freq / args.rope_scaling_factor + (1 - smooth) * inv_freq",
        ("tests/test_model.py::test_rope_scaling_matches_the_llama31_reference_formula",),
    ),
    Mutant(
        "time_limit_ignored", "training.time_limit_minutes never stops the run",
        "torchllm/run/stopping.py",
        "            if elapsed + 2 * slowest_step + 60 > 60 * tcfg.time_limit_minutes:",
        "            if False:",
        ("tests/test_train.py::test_time_limit_saves_and_stops_before_the_limit",),
    ),
    Mutant(
        "initial_load_model_only_ignored", "initial_load_path always loads the whole state",
        "torchllm/checkpoint/loading.py",
        "            model_only = self.cfg.initial_load_model_only\n",
        "            model_only = False\n",
        ("tests/test_checkpoint.py::test_initial_load_model_only_or_full_state",),
    ),
    Mutant(
        "ranks_stop_alone", "a rank that gets SIGTERM stops without telling the others",
        "torchllm/run/stopping.py",
        "        if any_rank(reason is not None, self.device) and reason is None:",
        "        if False:",
        ("tests/test_checkpoint_dist.py::test_sigterm_on_one_rank_stops_both_at_the_same_step",),
    ),
    Mutant(
        "comm_hook_not_registered", "parallelism.ddp_comm_hook is accepted but never registered",
        "torchllm/parallel/data_parallel.py",
        "        model.register_comm_hook(dp_mesh.get_group(), hook)",
        "        pass",
        ("tests/test_parallel_multiprocess.py::test_fp16_comm_hook_is_registered_and_reduces_in_fp16",),
    ),
    Mutant(
        "estimator_drops_attention_activations",
        "the memory estimator forgets the attention activations of every block",
        "torchllm/tools/activation_bytes.py",
        "    return tokens * (attention + ffn) * act + stats",
        "    return tokens * ffn * act + stats",
        ("tests/test_estimate_memory.py::test_estimate_within_5_percent_of_measured_on_debug"
         "[activations]",),
    ),
    Mutant(
        "dropout_in_eval", "dropout stays on in eval mode (validation, generation)",
        "torchllm/models/llama/model.py",
        "        p = self.dropout if self.training and cache is None else 0.0",
        "        p = self.dropout if cache is None else 0.0",
        ("tests/test_model.py::test_dropout_is_training_only_and_follows_the_seed",),
    ),
    Mutant(
        "loader_workers_left_running", "Trainer.close leaves the data loader's workers running",
        "torchllm/train.py", "        self.train_loader.close(self.batches)\n", "",
        ("tests/test_data.py::test_train_stops_its_loader_workers",),
    ),
    Mutant(
        "precision_per_rank", "each rank keeps its own auto-precision verdict (no vote)",
        "torchllm/precision.py", "    agreed, split = _agree(native)\n",
        "    agreed, split = native, False\n",
        ("tests/test_precision.py::test_auto_precision_is_the_same_on_every_rank",),
    ),
    Mutant(
        "partial_norm_local", "a Partial DTensor's norm is taken of this rank's pending share",
        "torchllm/metrics/norms.py", "            t = t.full_tensor()\n",
        "            t = t.to_local()\n",
        ("tests/test_metrics_dist.py::test_reductions_norms_and_per_rank_folders_over_two_ranks",),
    ),
    Mutant(
        "float_range_allows_inf", "a config float Range lets inf through (lr=inf trains to NaN)",
        "torchllm/config/fields.py", "        if not math.isfinite(x):\n            return False\n",
        "",
        ("tests/test_config.py::test_every_float_key_refuses_nan_and_inf",),
    ),
    Mutant(
        "run_name_dotdot", "job.run_name = '..' is accepted (overwrite deletes the dump folder)",
        "torchllm/config/paths.py", 'return name in ("", ".", "..") or',
        'return name in ("", ".") or',
        ("tests/test_run_safety.py::test_run_name_is_one_folder_name_and_other_runs_survive",),
    ),
    Mutant(
        "subfolder_dotdot", "checkpoint.folder / metrics.tb_folder may climb out with '..'",
        "torchllm/config/paths.py", 'or ".." in posix.parts ', "",
        ("tests/test_run_safety.py::test_folder_keys_stay_below_their_folder",),
    ),
    Mutant(
        "lock_takeover_unverified", "a stale-lock takeover renames aside whatever run.lock is "
        "by then (another launch's new lock), so two launches both hold the run folder",
        "torchllm/run/runlock.py",
        """            if _identity(self.path) != ident:
                return False  # renewed, released or taken over since it was read
""" + LOCK_LOG + LOCK_ASIDE + """            if _identity(aside) != ident:  # a new lock, created in between: put it back
                try:
                    os.link(aside, self.path)
                except FileExistsError:
                    pass
                aside.unlink()
                return False
""", LOCK_LOG + LOCK_ASIDE,
        ("tests/test_runlock.py::test_racing_launches_take_over_a_stale_lock_once",
         "tests/test_runlock.py::test_a_takeover_judged_on_an_earlier_read_leaves_the_new_lock"),
    ),
    Mutant(
        "prepare_in_place", "prepare writes its shards straight into --out (no swap at the end)",
        "torchllm/data/prepare.py",
        "        index = _prepare(dcfg, tokenizer_spec, tmp, shard_tokens,",
        "        index = _prepare(dcfg, tokenizer_spec, out, shard_tokens,",
        ("tests/test_data_safety.py::"
         "test_prepare_into_a_used_folder_keeps_the_old_shards_until_it_succeeds",),
    ),
    Mutant(
        "unlisted_shard_read", "training ignores shard files index.json does not list",
        "torchllm/data/sources/shards.py",
        "        if SHARD_FILE.fullmatch(name) and name not in listed:",
        "        if False:",
        ("tests/test_data_safety.py::test_training_refuses_a_shard_not_listed_in_the_index",),
    ),
    Mutant(
        "sft_without_targets", "chat data with no assistant turn trains (loss nan, 0 tokens)",
        "torchllm/data/packing/chat.py", "    if not mask[: source.windows_per_epoch, 1:].any():",
        "    if False:",
        ("tests/test_data_safety.py::test_sft_data_without_an_assistant_turn_stops_at_start",),
    ),
    Mutant(
        "export_mode_0600", "exported .safetensors keep safetensors' 0600 mode",
        "torchllm/hf/files.py", "    os.chmod(path, file_mode())\n", "",
        ("tests/test_hf_export.py::"
         "test_export_files_follow_the_umask_and_are_replaced_only_with_overwrite",),
    ),
    Mutant(
        "output_replaced", "convert to-file / to-dcp silently replace an existing output",
        "torchllm/hf/files.py", "    if out.exists() and not overwrite:\n",
        "    if False:\n",
        ("tests/test_hf_export.py::"
         "test_export_files_follow_the_umask_and_are_replaced_only_with_overwrite",),
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
        "continuation_encoded_apart",
        "a scored continuation is encoded on its own and appended to the context's ids",
        "torchllm/eval/continuation.py",
        "    whole = tokenizer.encode(context + continuation, bos=True)\n",
        "    whole = tokenizer.encode(context, bos=True) + tokenizer.encode(continuation)\n",
        ("tests/test_eval_continuation.py::test_hellaswag_endings_are_encoded_as_the_whole_string"
         "[sp_auto]",
         "tests/test_eval_hellaswag.py::test_scoring_matches_brute_force_on_a_tiny_file",
         "tests/test_eval_downstream.py::test_scorer_matches_brute_force_on_real_rows"
         "[arc_easy-mc]"),
    ),
    Mutant(
        "completion_decoded_alone",
        "generate prints the completion decoded apart from its prompt (loses the boundary space)",
        "torchllm/generate.py",
        "            print(completion_text(tokenizer, prompts[i], ids), file=stdout)\n",
        "            print(readable(tokenizer, ids), file=stdout)\n",
        ("tests/test_generate.py::test_cli_prints_the_completion_as_the_whole_sequence_decodes",),
    ),
    Mutant(
        "interactive_completion_decoded_alone",
        "generate --interactive streams the completion decoded apart from its prompt",
        "torchllm/generate.py",
        "stream_completion(tokenizer, generate_stream(model, ids, **sampling), stdout, ids)",
        "stream_completion(tokenizer, generate_stream(model, ids, **sampling), stdout)",
        ("tests/test_generate_interactive.py::test_interactive_cli_answers_each_stdin_line",),
    ),
    Mutant(
        "mixture_stream_position_lost",
        "a resumed mixture restores its batch count but not its streamed sources' positions",
        "torchllm/data/mixture.py", "            src.load_state_dict(state[\"streams\"][s])\n",
        "            pass\n",
        ("tests/test_data_kinds.py::test_a_mixture_with_a_stream_resumes_exactly",),
    ),
    Mutant(
        "tokenizer_paragraphs_only",
        "the tokenizer trainer gets blank-line paragraphs (long ones are silently skipped)",
        "torchllm/data/tokenizer_training.py", "            for chunk in training_chunks(text):\n",
        "            for chunk in text.split(\"\\n\\n\"):\n",
        ("tests/test_tokenizer_text.py::test_nothing_is_silently_dropped",
         "tests/test_tokenizer_text.py::test_the_train_cli_on_a_single_real_shaped_file"),
    ),
    Mutant(
        "launcher_skips_data_check", "run_train.sh's pre-flight check does not parse the data",
        "torchllm/run/launch.py", "    check_data(cfg)  # every dataset spec, by the code the trainer "
        "parses them with\n", "",
        ("tests/test_data_kinds.py::test_the_launcher_checks_specs_with_the_trainers_parser",),
    ),
    Mutant(
        "hellaswag_data_dir_file_ignored",
        "the downstream HellaSwag task ignores <data_dir>/hellaswag.jsonl (needs the network)",
        "torchllm/eval/tasks.py",
        "    if jsonl is not None and jsonl.is_file():\n",
        "    if False:\n",
        ("tests/test_eval_downstream.py::"
         "test_hellaswag_task_reads_the_data_dir_file_before_eval_hellaswag_data",),
    ),
    Mutant(
        "eval_cli_overrides_dropped",
        "the eval CLIs accept --section.key=value overrides but load the run's config without them",
        "torchllm/eval/loading.py",
        '    cfg = load_config(["--job.config_file", str(config_path), *overrides])\n',
        '    cfg = load_config(["--job.config_file", str(config_path)])\n',
        ("tests/test_eval_downstream.py::test_cli_applies_config_overrides",
         "tests/test_eval_hellaswag.py::test_cli_applies_config_overrides"),
    ),
    Mutant(
        "downstream_default_tasks_without_hellaswag",
        "the downstream CLI's default task set leaves HellaSwag out",
        "torchllm/eval/tasks.py",
        '"commonsense_qa", "social_iqa", "sciq", "sciq_lm", "hellaswag")',
        '"commonsense_qa", "social_iqa", "sciq", "sciq_lm")',
        ("tests/test_eval_downstream.py::"
         "test_cli_runs_the_default_tasks_offline_with_a_local_hellaswag_file",),
    ),
    Mutant(
        "shape_keys_ignored", "the [model] shape keys are checked but never applied",
        "torchllm/models/registry.py", "        return dataclasses.replace(args, **changes, **shape)\n",
        "        return dataclasses.replace(args, **changes)\n",
        ("tests/test_model_shapes.py::"
         "test_gpt2_4x128_and_llama_20_layers_match_a_by_hand_count",),
    ),
    Mutant(
        "moe_capacity_exact", "MoE's padded path uses the exact capacity: a new matmul shape "
        "almost every step (oneDNN caches one kernel per shape: RSS grows)",
        "torchllm/models/moe.py",
        "        capacity = max(load, 1) if torch.compiler.is_compiling() else padded_capacity(load)\n",
        "        capacity = max(load, 1)\n",
        ("tests/test_moe_memory.py::"
         "test_rss_stays_flat_over_many_steps[qwen3_moe-extra0]",),
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
        "export_without_chat_template", "the export writes no chat_template for a chat run",
        "torchllm/hf/tokenizer.py",
        '        config["chat_template"], end_of_turn = found\n',
        "        end_of_turn = found[1]\n",
        ("tests/test_hf_tokenizer_export.py::"
         "test_chat_template_in_the_export_gives_the_runs_chat_ids",),
    ),
    Mutant(
        "chat_mask_past_end_of_turn",
        "a Jinja template's loss mask also trains what follows the end-of-turn token",
        "torchllm/data/chat/jinja.py",
        "                trained[k] = last is None or k <= last\n",
        "                trained[k] = True\n",
        ("tests/test_chat_template.py::"
         "test_own_template_renders_like_transformers_and_masks_the_assistant_turns",),
    ),
    Mutant(
        "report_loss_against_steps", "the report's loss plot ignores the tokens seen",
        "torchllm/report/plots.py",
        "                x = run.tokens_at(series.steps) if by_tokens else series.steps\n",
        "                x = series.steps\n",
        ("tests/test_report.py::test_the_run_writes_a_report_whose_plots_are_the_events_values",),
    ),
    Mutant(
        "training_lines_on_stderr", "the trainer's INFO lines go to stderr, not stdout",
        "torchllm/log.py", "        out = logging.StreamHandler(sys.stdout)\n",
        "        out = logging.StreamHandler(sys.stderr)\n",
        ("tests/test_report.py::test_train_log_stdout_stderr_and_the_end_block",),
    ),
    Mutant(
        "run_log_overwritten", "a resumed launch overwrites train.log instead of appending",
        "torchllm/log.py", 'open(Path(run_dir) / RUN_LOG, "a", encoding="utf-8")',
        'open(Path(run_dir) / RUN_LOG, "w", encoding="utf-8")',
        ("tests/test_report.py::test_train_log_stdout_stderr_and_the_end_block",),
    ),
    Mutant(
        "header_validation_when_off", "the header names the validation split when validation is off",
        "torchllm/metrics/header.py",
        "    held_out = val_dataset.describe() if validation else \"\"\n",
        "    held_out = val_dataset.describe()\n",
        ("tests/test_header_fixes.py::test_validation_is_named_only_when_it_is_on",),
    ),
    Mutant(
        "ran_out_every_epoch", "a mixture source logs every epoch it runs out",
        "torchllm/data/mixture.py", "                if self.rollovers[s] == 1:\n",
        "                if self.rollovers[s] >= 1:\n",
        ("tests/test_header_fixes.py::test_a_source_that_runs_out_every_step_says_so_once",),
    ),
    Mutant(
        "torchrun_tee_left", "torchrun's tee folder is left under TMPDIR",
        "torchllm/run/launch.py", "    if args.log_dir is None:  # torchrun's tee files",
        "    if False:  # torchrun's tee files",
        ("tests/test_train.py::test_run_train_sh_end_to_end",),
    ),
    Mutant(
        "eval_loss_bits_in_nats", "eval.loss's bits per byte counts nats",
        "torchllm/eval/loss.py", '    bits = m["val/loss"] * m["val/tokens"] / math.log(2)\n',
        '    bits = m["val/loss"] * m["val/tokens"]\n',
        ("tests/test_eval_loss.py::test_checkpoint_loss_equals_in_training_validation_on_the_same"
         "_windows",),
    ),
    Mutant(
        "no_bar_through_launcher", "run_train.sh on a terminal draws no progress bar",
        "torchllm/run/launch.py", "    if sys.stdout.isatty():  # rank 0 reports its step",
        "    if False:  # rank 0 reports its step",
        ("tests/test_console.py::test_run_train_sh_draws_the_bar_on_a_pseudo_terminal",),
    ),
    Mutant(
        "failed_build_keeps_state", "a Trainer that fails to build keeps deterministic kernels "
        "and its run lock (the next Trainer in the process inherits both)",
        "torchllm/train.py",
        "            if self.run_lock is not None:\n                self.run_lock.release()\n"
        "            restore_determinism(self.determinism)\n            raise",
        "            raise",
        ("tests/test_run_safety.py::test_a_trainer_that_fails_to_build_gives_back_what_it_took",),
    ),
    Mutant(
        "bytes_prefix_space", "the bytes tokenizer adds a space before each text (ids shift)",
        "torchllm/data/byte_tokenizer.py", "ByteLevel(add_prefix_space=False, use_regex=True)",
        "ByteLevel(add_prefix_space=True, use_regex=True)",
        ("tests/test_hf_tokenizer_export.py::test_bytes_tokenizer_is_utf8_bytes_and_exports_with_"
         "the_same_ids",),
    ),
    Mutant(
        "same_recipe_default_beta2", "the benchmark's 'same recipe' forgets nanoGPT's beta2 "
        "(torchllm's 0.95 instead of 0.99)",
        "benchmarks/bench_time_to_loss.py",
        "        f\"--optimizer.beta2={r['beta2']}\", ", "        ",
        ("tests/test_time_to_loss.py::test_same_recipe_is_the_reference_model_schedule_and_split",),
    ),
    Mutant(
        "speedrun_validates_a_sample", "the speedrun config validates on 10 batches, not on all of "
        "nanoGPT's held-out 10%",
        "train_configs/speedrun_shakespeare_cpu.toml",
        "steps = 100000   # every held-out window\n", "\n",
        ("tests/test_train_configs.py::test_speedrun_config_runs_through_run_train_sh_on_its_"
         "default_text",),
    ),
    Mutant(
        "chat_hub_read_whole", "chat:hf:NAME conversations are read whole at start, not streamed",
        "torchllm/data/packing/chat.py", "        if ds.source.streams:\n", "        if False:\n",
        ("tests/test_chat_stream.py::test_a_chat_hub_dataset_is_streamed_not_read_whole",
         "tests/test_chat_stream.py::test_a_chat_stream_serves_whole_conversations_in_stream_order"),
    ),
    Mutant(
        "chat_stream_mask_not_restored", "a resumed chat stream loses the loss mask of its "
        "unbatched tokens", "torchllm/data/sources/hf.py",
        "    def load_state_dict(self, state: dict) -> None:\n        self.state = state\n",
        "    def load_state_dict(self, state: dict) -> None:\n        self.state = {**state, "
        "**({'trained': [True] * len(state['trained'])} if 'trained' in state else {})}\n",
        ("tests/test_chat_stream.py::test_a_text_and_chat_stream_mixture_resumes_exactly",),
    ),
    Mutant(
        "from_initial_load_without_path", "from_initial_load with an empty initial_load_path "
        "is not named as such", "torchllm/config/job_config.py",
        '        if self.data.tokenizer == "from_initial_load" and not '
        'self.checkpoint.initial_load_path:\n',
        "        if False:\n",
        ("tests/test_stage_tokenizer.py::test_without_initial_load_path_it_is_one_line",),
    ),
    Mutant(
        "stage_config_keeps_from_initial_load", "the run's config keeps "
        "'from_initial_load', not the tokenizer it resolved to", "torchllm/run/resolve.py",
        "    cfg = stage_tokenizer(cfg, log=rank() == 0)\n",
        "    stage_tokenizer(cfg, log=rank() == 0)\n",
        ("tests/test_stage_tokenizer.py::test_run_train_sh_stages_use_the_tokenizer_their_initial_"
         "load_trained_with",),
    ),
    Mutant(
        "generate_overrides_dropped", "generate parses --section.key=value but ignores it",
        "torchllm/generate.py",
        "        model, cfg, tokenizer = load_for_inference(args.checkpoint, device, overrides)\n",
        "        model, cfg, tokenizer = load_for_inference(args.checkpoint, device)\n",
        ("tests/test_generate.py::test_cli_takes_config_overrides_like_the_eval_clis",),
    ),
    Mutant(
        "model_info_table_without_shape", "model_info's table has no shape row",
        "torchllm/tools/model_info.py", "        f\"  shape            {info['shape']}\",\n", "",
        ("tests/test_model_shapes.py::test_model_info_table_and_json_show_the_shape",),
    ),
    Mutant(
        "end_block_prompt_for_chat_runs", "a chat run's end-of-run block suggests --prompt",
        "torchllm/report/hook.py", "            ask = ('--chat \"Hi! How are you?\"' if "
        "reads_conversations(cfg.data)\n", "            ask = ('--chat \"Hi! How are you?\"' "
        "if False\n",
        ("tests/test_data_kinds.py::test_run_train_sh_trains_the_shipped_sft_config",),
    ),
    Mutant(
        "harness_truncation_off_by_one", "a long request keeps max_length - 1 tokens of input, "
        "not max_length (lm-eval's hf model keeps the last max_length + 1, drops the last)",
        "torchllm/eval/harness/model.py",
        "            inputs.append((ctx + cont)[-(self.max_length + 1):][:-1])\n",
        "            inputs.append((ctx + cont)[-self.max_length:][:-1])\n",
        ("tests/test_harness.py::test_requests_equal_lm_eval_hf_model_on_the_export",),
    ),
    Mutant(
        "harness_rolling_scores_bos", "loglikelihood_rolling encodes the text with BOS, so "
        "the first window scores a BOS after the prefix BOS",
        "torchllm/eval/harness/model.py",
        "            ids = self.tokenizer.encode(text)  # no BOS",
        "            ids = self.tokenizer.encode(text, bos=True)  # no BOS",
        ("tests/test_harness.py::test_requests_equal_lm_eval_hf_model_on_the_export",),
    ),
    Mutant(
        "harness_context_without_bos", "loglikelihood contexts are encoded without BOS",
        "torchllm/eval/harness/model.py",
        "        return self.tokenizer.encode(string, bos=add_special_tokens is not False)",
        "        return self.tokenizer.encode(string, bos=bool(add_special_tokens))",
        ("tests/test_harness.py::test_requests_equal_lm_eval_hf_model_on_the_export",
         "tests/test_harness.py::test_predictions_equal_downstream_where_the_formats_agree"),
    ),
    Mutant(
        "harness_scores_misordered", "a batch's scores go back to the requests in index order, "
        "not in the length-sorted order they were computed in",
        "torchllm/eval/harness/model.py",
        "            for i, (ll, greedy) in zip(batch, self._score([pieces[i] for i in batch])):",
        "            for i, (ll, greedy) in zip(sorted(batch),\n"
        "                                       self._score([pieces[i] for i in batch])):",
        ("tests/test_harness.py::test_requests_equal_lm_eval_hf_model_on_the_export",),
    ),
    Mutant(
        "harness_gather_own_rank_only", "rank 0 keeps only its own documents' results",
        "torchllm/eval/harness/model.py",
        "        return parts if self._rank == dst else None",
        "        return [obj] if self._rank == dst else None",
        ("tests/test_harness.py::test_two_ranks_equal_one_rank",),
    ),
    Mutant(
        "harness_stop_sequences_ignored", "generate_until returns the text past its stop sequence",
        "torchllm/eval/harness/model.py", "        if stop:\n", "        if False:\n",
        ("tests/test_harness.py::test_generate_until_stops_at_stop_sequences_and_equals_greedy_decoding",),
    ),
    Mutant(
        "harness_missing_lm_eval_traceback", "without lm-eval the CLI dies with a traceback",
        "torchllm/eval/harness/cli.py", "    except ImportError:\n        print(INSTALL_HINT",
        "    except OSError:\n        print(INSTALL_HINT",
        ("tests/test_harness.py::test_missing_lm_eval_is_one_clear_line",),
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
        "harness_long_continuation_cut",
        "a continuation longer than max_length keeps one token of context per window",
        "torchllm/eval/harness/model.py",
        "            pieces.append((full[max(0, end - 1 - self.max_length) : start], full[start:end]))",
        "            pieces.append((full[start - 1 : start], full[start:end]))",
        ("tests/test_harness.py::test_requests_equal_lm_eval_hf_model_on_the_export",),
    ),
    Mutant(
        "harness_generates_past_stop",
        "generate_until runs every request to max_gen_toks, cutting at the stop sequence after",
        "torchllm/eval/harness/model.py",
        "                                     stop_when=stopped)",
        "                                     stop_when=None)",
        ("tests/test_harness.py::test_generate_until_stops_at_stop_sequences_and_equals_greedy_"
         "decoding",),
    ),
    Mutant(
        "remote_shards_read_whole",
        "a shard object on a store is fetched whole for every window (not its byte range)",
        "torchllm/data/token_stream.py",
        "        data = self.storage.read_range(self.part.path, base + lo * self.itemsize,\n"
        "                                       base + hi * self.itemsize)\n"
        "        return np.frombuffer(data, dtype=self.part.dtype)\n",
        "        data = self.storage.read_range(self.part.path, base,\n"
        "                                       base + self.part.length * self.itemsize)\n"
        "        return np.frombuffer(data, dtype=self.part.dtype)[lo:hi]\n",
        ("tests/test_object_storage.py::test_shards_on_a_bucket_train_the_same_batches_as_on_"
         "disk",),
    ),
    Mutant(
        "remote_shards_header_as_tokens",
        "ranged reads of a shard object start at the file's first byte, not after the header",
        "torchllm/data/token_stream.py",
        "        base = self.part.offset\n",
        "        base = 0\n",
        ("tests/test_object_storage.py::test_shards_on_a_bucket_train_the_same_batches_as_on_"
         "disk",),
    ),
    Mutant(
        "harness_scores_padding",
        "a right-padded request's continuation is read at the batch's last positions (padding)",
        "torchllm/eval/harness/model.py",
        "            logp = logits[i, len(ids) - len(cont) : len(ids)].float().log_softmax(dim=-1)",
        "            logp = logits[i, tokens.shape[1] - len(cont) :].float().log_softmax(dim=-1)",
        ("tests/test_harness.py::test_every_family_scores_batched_requests_as_one_at_a_time",),
    ),
    Mutant(
        "loss_size_rule_ignored",
        "bf16 logits always take the chunked cross entropy, however small (the size rule lost)",
        "torchllm/loss.py",
        "    return 4 * logits_numel <= _PLAIN_MAX_BYTES",
        "    return False",
        ("tests/test_speed_paths.py::test_fused_cross_entropy_equals_float32_cross_entropy",),
    ),
    Mutant(
        "estimate_ignores_loss_size_rule",
        "the memory estimator counts small bf16 logits as the chunked cross entropy's",
        "torchllm/tools/activation_bytes.py",
        "    if act != FP32 and not plain_kernels(vocab_tokens):",
        "    if act != FP32:",
        ("tests/test_estimate_memory.py::test_estimate_within_5_percent_of_measured_on_debug",),
    ),
    Mutant(
        "bench_ratio_population_sd",
        "the throughput benchmark's interval uses the population standard deviation (too narrow)",
        "benchmarks/bench_throughput.py",
        "    half = t * statistics.stdev(logs) / math.sqrt(len(logs))",
        "    half = t * statistics.pstdev(logs) / math.sqrt(len(logs))",
        ("tests/test_bench.py::test_throughput_ratio_is_paired_with_a_t_interval",),
    ),
    Mutant(
        "bench_ratio_arithmetic_mean",
        "the throughput benchmark's ratio is the arithmetic mean of the rounds' ratios, not "
        "their geometric mean",
        "benchmarks/bench_throughput.py",
        "    return math.exp(mean), (math.exp(mean - half), math.exp(mean + half))",
        "    return statistics.fmean(ratios), (math.exp(mean - half), math.exp(mean + half))",
        ("tests/test_bench.py::test_throughput_ratio_is_paired_with_a_t_interval",),
    ),
    Mutant(
        "compiled_rope_backward_sign",
        "the compiled bf16 RoPE's own backward rotates by +angle (the forward's direction)",
        "torchllm/models/llama/model.py",
        "        return _rotate_pairs(grad, cos, -sin), None, None",
        "        return _rotate_pairs(grad, cos, sin), None, None",
        ("tests/test_speed_paths.py::test_rope_equals_the_written_out_rotation",),
    ),
    # --- golden curves ---
    Mutant(
        "golden_init_std", "Llama's linear layers initialized with std 1/sqrt(fan_out), not fan_in",
        "torchllm/models/llama/model.py",
        "std = scale / math.sqrt(linear.in_features)",
        "std = scale / math.sqrt(linear.out_features)",
        ("tests/test_golden_curves.py::test_single_process_curve[llama]",),
    ),
    Mutant(
        "golden_rope_theta_default", "Llama's default RoPE base frequency is 10000 (Llama 2's)",
        "torchllm/models/llama/args.py",
        "    rope_theta: float = 500000.0\n",
        "    rope_theta: float = 10000.0\n",
        ("tests/test_golden_curves.py::test_single_process_curve[llama]",),
    ),
    Mutant(
        "golden_warmup_off_by_one",
        "the LR schedule is evaluated at the completed-step count: step 1 runs at LR 0",
        "torchllm/optim/lr_schedule.py",
        "lambda done: factor(done + 1) * scale(done + 1)",
        "lambda done: factor(done) * scale(done + 1)",
        ("tests/test_golden_curves.py::test_single_process_curve[llama]",),
    ),
    Mutant(
        "golden_checkpoint_key_renamed",
        "a refactor renames a checkpoint state key: its own saves load, older checkpoints do not",
        "torchllm/checkpoint/checkpointer.py",
        'self.states["train_state"] = PickledState(train_state)',
        'self.states["trainer_state"] = PickledState(train_state)',
        ("tests/test_golden_curves.py::test_recorded_checkpoint_resumes_exactly",),
    ),
    # --- fresh clone / offline Hub (issue 43) ---
    Mutant(
        "local_data_not_preflighted", "the launcher's pre-flight check does not look for local files",
        "torchllm/data/sources/local.py",
        "        local_files(self.location)  # a missing file",
        "        pass  # a missing file",
        ("tests/test_run_safety.py::test_launcher_config_error_is_one_line_before_torchrun",),
    ),
    Mutant(
        "hub_probe_skipped", "a Hub lookup offline waits through huggingface_hub's retries",
        "torchllm/hub.py",
        "    if not hub_reachable():\n        set_offline()\n        return True\n    return False",
        "    return False",
        ("tests/test_fresh_clone.py::test_hub_config_fails_offline_in_one_line[llama3_1b]",),
    ),
    Mutant(
        "cpu_peak_raised_to_fit", "the CPU peak is raised to what a step reached (MFU ~100% by construction)",
        "torchllm/metrics/flops.py",
        "        if achieved > self.flops and not self.warned:",
        "        self.flops = max(self.flops, achieved)\n        if achieved > self.flops and not self.warned:",
        ("tests/test_precision.py::test_cpu_peak_is_measured_once_per_machine_and_never_raised",
         "tests/test_precision.py::test_mfu_is_against_the_cached_peak"),
    ),
    Mutant(
        "cpu_peak_not_cached", "the CPU peak is measured again at every start",
        "torchllm/metrics/flops.py",
        "    if remeasure or not isinstance(entry, dict) or not entry.get(\"flops\"):",
        "    if True:",
        ("tests/test_precision.py::test_cpu_peak_is_measured_once_per_machine_and_never_raised",
         "tests/test_precision.py::test_mfu_is_against_the_cached_peak"),
    ),
    Mutant(
        "console_loss_is_the_steps_own", "the console's loss is the logging step's own, not the interval's mean",
        "torchllm/metrics/metrics_logger.py",
        "                                      loss=self.interval_loss()))",
        "                                      loss=None))",
        ("tests/test_metrics.py::test_console_loss_is_the_mean_over_the_logging_interval",),
    ),
    Mutant(
        "val_held_out_per_local_batch",
        "the held-out set is validation.steps x local batch windows (with 1 rank accumulating, "
        "half of what 2 ranks score: val/loss depends on the layout)",
        "torchllm/eval/in_training.py",
        "        n = min(len(windows), vcfg.steps * global_batch)\n        batches = HeldOut",
        "        n = min(len(windows), vcfg.steps * local)\n        batches = HeldOut",
        ("tests/test_eval_validation.py::test_validation_is_the_same_on_every_layout[fsdp2]",),
    ),
    Mutant(
        "val_reduced_over_the_world",
        "validation sums loss and tokens over every rank, not the data-parallel group (pipeline "
        "peers count the same batch twice)",
        "torchllm/eval/in_training.py",
        "trainer.autocast, group=trainer.parallel_dims.dp_group,",
        "trainer.autocast, group=None,",
        ("tests/test_eval_validation.py::test_validation_is_the_same_on_every_layout[pp2]",),
    ),
    Mutant(
        "val_share_drops_the_remainder",
        "each rank's share of the held-out windows is floor(n / dp degree): the last windows are "
        "scored by one process, left out by several",
        "torchllm/eval/in_training.py",
        "        share = -(-n // dp_degree)\n",
        "        share = n // dp_degree\n",
        ("tests/test_eval_validation.py::"
         "test_held_out_windows_are_shared_out_whole_in_equal_full_batches",),
    ),
    Mutant(
        "prepare_val_takes_big_documents_whole",
        "prepare gives validation a whole document whenever it is behind its fraction, counting "
        "the document first (one big document makes most of the corpus validation)",
        "torchllm/data/prepare.py",
        "        if n <= max(room, self.WHOLE_DOCUMENT):\n",
        "        if True:\n",
        ("tests/test_prepare_split.py::test_a_big_document_cannot_swell_the_validation_split",),
    ),
    Mutant(
        "report_mixture_rows_as_repr", "the comparison report shows a mixture's unused data.dataset and a DataSource repr",
        "torchllm/report/markdown.py",
        '        flat["data.sources"] = ", ".join(f"{s.dataset} x {s.weight:g}" for s in sources)\n'
        '        flat["data.dataset"] = "(mixture: data.sources)"',
        "        pass",
        ("tests/test_report.py::test_differences_show_a_mixtures_sources_and_weights",),
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
        "export_skips_checksums",
        "hf export resolves the checkpoint without checking it (a flipped byte exports)",
        "torchllm/hf/export.py",
        "else open_checkpoint(checkpoint)",
        "else CheckpointReader.find(checkpoint)",
        ("tests/test_checkpoint_trust.py::test_generate_and_export_refuse_a_flipped_byte",),
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
        "chat_packing_causal_by_default",
        "chat data keeps plain causal attention over the packed window (conversations see the "
        "ones packed before them)",
        "torchllm/config/job_config.py",
        '    return (("block_causal" if chat else "causal") if mask == "auto" else mask,',
        '    return ("causal" if mask == "auto" else mask,',
        ("tests/test_chat_isolation.py::test_packed_conversations_train_as_if_each_were_alone",),
    ),
    Mutant(
        "chat_packing_positions_run_on",
        "chat data's positions run on over the packed window (restart off by default)",
        "torchllm/config/job_config.py",
        "            chat if restart is None else restart)",
        "            False if restart is None else restart)",
        ("tests/test_chat_isolation.py::test_packed_conversations_train_as_if_each_were_alone",),
    ),
    Mutant(
        "chat_packing_explicit_causal_accepted",
        "an explicit causal mask with packed conversations trains silently",
        "torchllm/data/packing/chat.py",
        '    if mask != "block_causal" or not restart:\n        key = (',
        '    if False:\n        key = (',
        ("tests/test_chat_isolation.py::test_packed_conversations_train_as_if_each_were_alone",),
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
        "chat_llama3_header_newlines_apart",
        "Llama 3's header \"\\n\\n\" tokenized apart from the content (a reply starting with "
        "\"\\n\" gets 271, 198 where apply_chat_template gives 1432)",
        "torchllm/data/chat/template.py",
        '                head = head[: -len(self.tokenizer.encode("\\n\\n"))]\n'
        '                body = self.tokenizer.encode("\\n\\n" + content)\n',
        '                body = self.tokenizer.encode(content)\n',
        ("tests/test_chat_template.py::test_every_tokenizer_kind_renders_36_conversations_"
         "like_transformers[tiktoken-llama3]",),
    ),
    Mutant(
        "chat_jinja_mask_by_token_start",
        "a template's token that merges the header's end with the reply's start is not a target "
        "(transformers' assistant mask counts it)",
        "torchllm/data/chat/jinja.py",
        "            inside = [k for k, (s, e) in enumerate(offsets) if s < end and e > start]",
        "            inside = [k for k, (s, e) in enumerate(offsets) if start <= s < end]",
        ("tests/test_chat_template.py::test_every_tokenizer_kind_renders_36_conversations_"
         "like_transformers[tokenizer.json-llama3-split]",),
    ),
    Mutant(
        "local_text_bom_kept",
        "a UTF-8 byte-order mark starting a local .txt file is read as text",
        "torchllm/data/sources/local.py",
        '            kwargs["encoding"] = "utf-8-sig"',
        '            kwargs["encoding"] = "utf-8"',
        ("tests/test_local_text_bom.py::test_a_bom_starting_a_local_text_file_is_not_read",),
    ),
    Mutant(
        "single_document_note_missing", "a one-file corpus gives its end to validation without a word",
        "torchllm/data/sources/base.py",
        "        if len(starts) == 1 and held_out:",
        "        if False:",
        ("tests/test_data_kinds.py::test_a_single_file_corpus_says_its_end_is_the_validation_split",),
    ),
    Mutant(
        "mixture_per_source_validation_uses_the_concatenation", "each source's validation loss is scored on the merged held-out set",
        "torchllm/eval/in_training.py",
        "                (source_label(i, src.dataset),\n                 HeldOutBatches(part,",
        "                (source_label(i, src.dataset),\n                 HeldOutBatches(windows,",
        ("tests/test_data_mixture.py::test_a_mixture_validates_each_source_on_its_own",),
    ),
    Mutant(
        "launch_stores_bind_all_interfaces",
        "a single-node launch leaves torchrun's TCPStores on torch's default (every interface)",
        "torchllm/run/launch.py",
        "        with loopback_stores() if local else contextlib.nullcontext():",
        "        with contextlib.nullcontext():",
        ("tests/test_launch_security.py::"
         "test_a_single_node_launch_listens_on_loopback_only_with_a_random_rendezvous_id",),
    ),
    Mutant(
        "launch_fixed_rendezvous_id",
        "a c10d rendezvous without RDZV_ID gets a fixed, guessable id",
        "torchllm/run/launch.py",
        "        args.rdzv_id = secrets.token_hex(16)",
        "        args.rdzv_id = \"torchllm\"",
        ("tests/test_launch_security.py::"
         "test_the_rendezvous_id_is_random_unless_given_and_required_on_several_nodes",),
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
        "prepare_disk_full_traceback",
        "prepare on a full disk ends in a traceback",
        "torchllm/data/prepare.py",
        "        if e.errno != errno.ENOSPC:\n",
        "        if True:\n",
        ("tests/test_store_errors.py::test_prepare_on_a_full_disk_is_one_line",),
    ),
    Mutant(
        "hf_import_bad_safetensors_unnamed",
        "hf import of a bad .safetensors prints safetensors' error without the file",
        "torchllm/hf/folder.py",
        "        except Exception as e:  # noqa: BLE001 - SafetensorError: truncated, empty, not "
        "one\n",
        "        except ImportError as e:\n",
        ("tests/test_hf_export.py::"
         "test_import_of_a_truncated_garbage_or_empty_safetensors_names_the_file",),
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
        "data_fingerprint_ignores_tokens",
        "the data fingerprint records the sources' names only: re-prepared shards resume at the "
        "old position",
        "torchllm/data/fingerprint.py",
        '    content = [stream_digest(s) if s is not None else "stream" for s in _streams(dataset)]\n',
        '    content = ["stream" for s in _streams(dataset)]\n',
        ("tests/test_resume_trust.py::test_resume_with_changed_data_says_what_changed_and_restarts_or_refuses[corpus]",),
    ),
    Mutant(
        "chat_padding_counted_as_processed", "a packed chat batch's padding counts as tokens processed",
        "torchllm/data/packing/chat.py",
        "    return (positions > 0).sum() + starts.sum()",
        "    return positions.numel()",
        ("tests/test_data_chat.py::test_unpadded_tokens_count_conversation_inputs_not_padding",),
    ),
    Mutant(
        "throughput_counts_trained_tokens", "tokens/s, MFU and tokens seen count only the trained (assistant) tokens",
        "torchllm/metrics/reduce.py",
        '    stats = {"loss": total[0] / total[1], "trained_tokens": total[1], "tokens": total[2]}',
        '    stats = {"loss": total[0] / total[1], "trained_tokens": total[1], "tokens": total[1]}',
        ("tests/test_data_chat.py::test_sft_throughput_counts_processed_tokens_and_trained_ones_apart",),
    ),
    Mutant(
        "inference_trains_the_tokenizer", "generate / evals / export train an 'auto' tokenizer "
        "a checkpoint lacks (on whatever data its config names)", "torchllm/data/__init__.py",
        "    if not train:\n        if not path.is_file():\n",
        "    if False:\n        if not path.is_file():\n",
        ("tests/test_stage_tokenizer.py::"
         "test_generate_never_trains_a_missing_tokenizer_nor_takes_another",),
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
        "stage_auto_trains_a_new_tokenizer", "data.tokenizer = 'auto' with initial_load_path "
        "trains a new tokenizer on the stage's data", "torchllm/run/tokenizer.py",
        '    return tok == FROM_INITIAL_LOAD or (tok == "auto" and '
        "bool(cfg.checkpoint.initial_load_path))\n",
        "    return tok == FROM_INITIAL_LOAD\n",
        ("tests/test_stage_tokenizer.py::"
         "test_a_stage_on_new_data_keeps_its_checkpoints_tokenizer",),
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
        "hf_initial_load_tokenizer_unchecked", "initial_load_in_hf accepts another tokenizer "
        "than the folder's", "torchllm/hf/load.py",
        '    check_same_tokenizer(hf_record(hf_dir), tokenizer,\n',
        '    (hf_record(hf_dir), tokenizer,\n',
        ("tests/test_stage_tokenizer.py::"
         "test_a_stage_from_a_hugging_face_export_keeps_its_tokenizer",),
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
        "hf_import_seed_without_tokenizer", "hf import writes a seed with no config.toml and no "
        "tokenizer", "torchllm/hf/load.py",
        "    save_seed_checkpoint(weights, out, step,\n"
        "                         lambda tmp: _seed_config_and_tokenizer(hf_dir, out, tmp, cfg, "
        "hf_vocab))\n",
        "    save_seed_checkpoint(weights, out, step)\n",
        ("tests/test_stage_tokenizer.py::"
         "test_hf_import_writes_a_seed_that_generates_and_passes_its_tokenizer_on",),
    ),
    Mutant(
        "lora_b_random_init", "LoRA's B starts random (step 0 is no longer the base model)",
        "torchllm/models/lora.py",
        "        nn.init.zeros_(self.lora_B.weight)",
        "        nn.init.normal_(self.lora_B.weight, std=0.02)",
        ("tests/test_lora.py::test_adapters_start_as_the_base_model_with_peft_init",),
    ),
    Mutant(
        "lora_base_not_frozen", "LoRA freezes only the wrapped linears (norms, embeddings train)",
        "torchllm/models/lora.py",
        "    for p in model.parameters():\n        p.requires_grad_(False)\n",
        "",
        ("tests/test_lora.py::test_adapters_start_as_the_base_model_with_peft_init",),
    ),
    Mutant(
        "lora_scaling_alpha_only", "LoRA's update is scaled by alpha, not alpha / rank",
        "torchllm/models/lora.py",
        "        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank",
        "        self.rank, self.alpha, self.scaling = rank, alpha, alpha",
        ("tests/test_lora.py::test_adapter_and_merged_exports_give_torchllm_logits[llama3]",),
    ),
    Mutant(
        "lora_b_not_permuted", "the PEFT export leaves lora_B of wq/wk in torchllm's RoPE layout",
        "torchllm/hf/peft_names.py",
        "            b = rope_meta_to_hf(b, heads)",
        "            pass",
        ("tests/test_lora.py::test_adapter_and_merged_exports_give_torchllm_logits[llama3]",),
    ),
    Mutant(
        "lora_merge_without_scaling", "the merged export adds B @ A without alpha / rank",
        "torchllm/models/lora.py",
        "        out[f\"{name}.weight\"] = (w.float() + scaling * (b @ a)).to(w.dtype)",
        "        out[f\"{name}.weight\"] = (w.float() + b @ a).to(w.dtype)",
        ("tests/test_lora.py::test_adapter_and_merged_exports_give_torchllm_logits[llama3]",),
    ),
    Mutant(
        "lora_initial_load_needs_adapters",
        "a LoRA run's initial load requires the adapters in the base checkpoint",
        "torchllm/models/lora.py",
        "    if resume or \"model\" not in sds:\n        return {}",
        "    if True:\n        return {}",
        ("tests/test_lora.py::test_adapter_and_merged_exports_give_torchllm_logits[llama3]",),
    ),
    Mutant(
        "estimate_lora_frozen_grads",
        "the memory estimator gives LoRA's frozen weights gradients and optimizer state",
        "torchllm/tools/estimate_memory.py",
        "    trained, grad_block = params, block_split\n    if cfg.lora.enable:",
        "    trained, grad_block = params, block_split\n    if False:",
        ("tests/test_lora.py::test_memory_estimate_counts_lora_as_the_benchmark_measures",),
    ),
    Mutant(
        "compiled_rope_rotates_backwards",
        "RoPE's compiled branch (what inductor runs on a GPU) rotates by -angle; eager is right",
        "torchllm/models/llama/model.py",
        "    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).type_as(x)",
        "    return torch.stack((x0 * cos + x1 * sin, -x0 * sin + x1 * cos), dim=-1).flatten(-2).type_as(x)",
        ("tests/test_gpu_harness.py::test_teacher_forced_oracle_passes_rounding_and_fails_a_compiled_rope_bug",),
    ),
    Mutant(
        "gpu_harness_teacher_forcing_off",
        "the oracle's path under test keeps its own weights instead of the reference's per step",
        "tests/gpu_harness.py",
        "            _local(p).copy_(record.weights[name].to(_local(p).dtype))",
        "            pass",
        ("tests/test_gpu_harness.py::test_teacher_forced_oracle_passes_rounding_and_fails_a_compiled_rope_bug",),
    ),
    Mutant(
        "gpu_test_leaves_matmul_precision", "a GPU test's TF32 switch outlives it ('highest' -> 'high')",
        "tests/gpu_harness.py",
        "        torch.set_float32_matmul_precision(precision)  # after allow_tf32: it sets this too",
        "        pass",
        ("tests/test_gpu_harness.py::test_restored_process_state_undoes_what_cuda_paths_change",),
    ),
    Mutant(
        "gpu_skip_by_keyword", "tests skip when any keyword (a folder's name) is 'gpu', not only marked ones",
        "tests/conftest.py",
        '        if item.get_closest_marker("gpu"):',
        '        if "gpu" in item.keywords:',
        ("tests/test_gpu_harness.py::test_only_tests_marked_gpu_skip_without_cuda",),
    ),
    Mutant(
        "bench_gpu_peer_ratio_unpaired", "bench_gpu pairs each variant round with another round's peer run",
        "benchmarks/bench_gpu.py",
        "                      for ours, peer in zip(runs[name], peer_runs)]",
        "                      for ours, peer in zip(runs[name], peer_runs[::-1])]",
        ("tests/test_gpu_harness.py::test_bench_gpu_cpu_path_reports_what_a_direct_run_measures",),
    ),
    Mutant(
        "bench_gpu_cpu_allows_float8", "bench_gpu on CPU starts a float8 variant (fails minutes later, unclearly)",
        "benchmarks/bench_gpu.py",
        "        if cuda_only:\n            p.exit(2,",
        "        if False:\n            p.exit(2,",
        ("tests/test_gpu_harness.py::test_bench_gpu_on_cpu_refuses_cuda_only_options_in_one_line",),
    ),
    Mutant(
        "chat_session_forgets_history", "generate --chat --interactive answers each turn without the conversation so far",
        "torchllm/generate.py",
        "            (ids,) = generate(model, [template.prompt(history)], **sampling)",
        "            (ids,) = generate(model, [template.prompt(list(system) + history[-1:])], **sampling)",
        ("tests/test_data_chat.py::test_sft_makes_the_model_reproduce_the_replies",),
    ),
    Mutant(
        "generation_config_without_sampling", "the export's generation_config.json leaves out the run's sampling defaults",
        "torchllm/hf/export.py",
        '    gen["max_new_tokens"] = sampling.max_new_tokens',
        '    pass',
        ("tests/test_hf_export.py::test_export_writes_a_generation_config_transformers_follows",),
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
    # --- speed levers (issue 46 item 3) ---
    Mutant(
        "cast_once_overwrites_grad", "cast_weights_once: a micro-step's bf16 gradient replaces the float32 gradient instead of adding to it",
        "torchllm/parallel/cast_once.py",
        "    if master.grad is None:\n        master.grad = grad.to(master.dtype)",
        "    if True:\n        master.grad = grad.to(master.dtype)",
        ("tests/test_speed_levers.py::test_cast_weights_once_equals_autocast_over_micro_steps_and_steps[False]",),
    ),
    Mutant(
        "cast_once_stale_copies", "cast_weights_once: the bf16 copies are made once, not refreshed after each optimizer step",
        "torchllm/parallel/cast_once.py",
        "        with torch.no_grad():\n            torch._foreach_copy_(",
        "        with torch.no_grad():\n            self.copied = getattr(self, \"copied\", 0) + 1\n            self.copied > 1 or torch._foreach_copy_(",
        ("tests/test_speed_levers.py::test_cast_weights_once_equals_autocast_over_micro_steps_and_steps[False]",),
    ),
    Mutant(
        "cudagraph_grads_not_owned", "compile.cudagraphs: the first gradient of a step stays the graph's output memory",
        "torchllm/parallel/levers.py",
        "            p.grad = p.grad.clone()\n",
        "            pass\n",
        ("tests/test_speed_levers.py::test_own_gradients_copies_the_first_gradient_of_a_step_once",),
    ),
    Mutant(
        "sdpa_backend_ignored", "model.sdpa_backend is accepted but never applied",
        "torchllm/parallel/levers.py",
        "    if backend == \"auto\":\n        return contextlib.nullcontext()",
        "    if True:\n        return contextlib.nullcontext()",
        ("tests/test_speed_levers.py::test_sdpa_backend_picks_the_kernel[math-False]",),
    ),
    Mutant(
        "compile_granularity_ignored", "compile.granularity = 'model' still compiles block by block",
        "torchllm/parallel/compile.py",
        "    if getattr(ccfg, \"granularity\", \"block\") == \"model\":",
        "    if False:",
        ("tests/test_speed_levers.py::test_compile_granularity_compiles_the_model_or_each_block",),
    ),
    Mutant(
        "cudagraphs_allowed_on_cpu", "compile.cudagraphs on CPU is not refused (inductor would fail later, or silently do nothing)",
        "torchllm/parallel/levers.py",
        "        if device_type != \"cuda\":\n            raise ConfigError(\n                \"compile.cudagraphs",
        "        if False:\n            raise ConfigError(\n                \"compile.cudagraphs",
        ("tests/test_speed_levers.py::test_gpu_only_levers_are_refused_on_cpu_in_one_line[extra1-leave it false]",),
    ),
    Mutant(
        "corpus_documents_without_eos",
        "an in-memory text source packs its documents without their EOS token",
        "torchllm/data/sources/base.py",
        "            tokenizer.encode(text, bos=True, eos=True) for text in self.texts()\n",
        "            tokenizer.encode(text, bos=True, eos=False) for text in self.texts()\n",
        ("tests/test_data_howto.py::test_a_toy_source_packs_its_documents_into_the_windows",),
    ),
    Mutant(
        "chat_prefix_not_a_packing",
        "chat:PATH is not told apart from a source spec (no packing prefix is recognised)",
        "torchllm/config/job_config.py",
        "    return (prefix, location) if sep and prefix in PACKINGS else (TEXT, None)\n",
        "    return (TEXT, None)\n",
        ("tests/test_data_kinds.py::test_the_registry_maps_each_prefix_to_its_source_module",),
    ),
    Mutant(
        "custom_import_ignored", "job.custom_import is accepted but never imported",
        "torchllm/config/loader.py",
        "        import_custom(cfg.job.custom_import)\n",
        "        import_custom(None)\n",
        ("tests/test_model_family_plugin.py::test_custom_import_that_fails_names_the_key",),
    ),
    Mutant(
        "missing_tp_plan_not_refused", "a family that declares no TP plan is run under TP anyway",
        "torchllm/parallel/parallelize.py",
        "    if dims.tp_enabled and spec.tp_plan is None:",
        "    if False and spec.tp_plan is None:",
        ("tests/test_model_family_plugin.py::"
         "test_a_family_without_a_tp_plan_refuses_tensor_parallelism",),
    ),
    Mutant(
        "qwen3_tp_plan_drops_qk_norm", "Qwen3's declared TP plan forgets the QK-norm style",
        "torchllm/models/qwen3/plan.py",
        "    block={**ATTENTION, **SWIGLU, **QK_NORM},",
        "    block={**ATTENTION, **SWIGLU},",
        ("tests/test_parallel_multiprocess.py::test_qk_norm_weights_replicated_over_tp",),
    ),
    Mutant(
        "storage_resolved_per_call", "storage_for makes a new file system (and checks the "
        "protocol's package) on every call instead of once per protocol",
        "torchllm/storage.py",
        "@lru_cache(maxsize=None)\ndef _storage_of(",
        "def _storage_of(",
        ("tests/test_storage_leaf.py::test_each_protocol_is_resolved_once",),
    ),
    # --- optimizer spec (docs/howto_optimizer.md) ---
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
    Mutant(
        "optimizer_name_not_checked_at_launch", "the launcher's pre-flight check does not look "
        "optimizer.name up (an unknown one fails only in every worker)",
        "torchllm/run/launch.py",
        "    optim.get(cfg.optimizer.name)  # a registered optimizer",
        "    optim  # a registered optimizer",
        ("tests/test_optimizer_plugin.py::test_unknown_optimizer_is_refused_by_the_launchers_check",),
    ),
    Mutant(
        "optimizer_registry_builds_adamw", "the trainer builds AdamW whatever optimizer.name "
        "names (the registry looked up, its builder not used)",
        "torchllm/optim/registry.py",
        "    return get(ocfg.name).build(model, ocfg, device)",
        "    return get(ocfg.name) and get(\"adamw\").build(model, ocfg, device)",
        ("tests/test_optimizer_plugin.py::"
         "test_toy_optimizer_trains_and_resumes_exactly_through_the_trainer",),
    ),
    # --- estimate_memory reads the family's ModelSpec ---
    Mutant(
        "qwen3_spec_forgets_qk_norm", "Qwen3's ModelSpec does not declare QK-norm: the memory "
        "estimate counts a Llama attention's activations for it",
        "torchllm/models/qwen3/__init__.py",
        "pipeline=PIPELINE, qk_norm=True,\n",
        "pipeline=PIPELINE,\n",
        ("tests/test_estimate_memory.py::"
         "test_estimate_within_5_percent_of_measured_on_debug[qwen3_qk_norm]",),
    ),
    Mutant(
        "stop_at_loss_ignored", "validation.stop_at_loss is read but never stops the run",
        "torchllm/eval/in_training.py",
        """            trainer.stops.target_loss(step, report.scalars["val/loss"],
                                      self.cfg.validation.stop_at_loss)
""",
        "",
        ("tests/test_stop_at_loss.py::test_run_train_sh_stops_at_the_target_with_a_final_checkpoint_and_report",),
    ),
    Mutant(
        "muon_ns_always_bf16", "Muon orthogonalizes in bf16 on CPUs without native bf16 (~20x slower)",
        "torchllm/optim/muon.py",
        "             ns_dtype=fast_ns_dtype(device)),",
        "             ns_dtype=torch.bfloat16),",
        ("tests/test_muon_ns_dtype.py::test_trainer_runs_newton_schulz_in_float32_on_a_cpu_without_native_bf16",),
    ),
    Mutant(
        "muon_ns_dtype_ignored", "the Newton-Schulz iteration runs in bf16 whatever ns_dtype says",
        "torchllm/optim/muon_ns.py",
        "    x = grad.to(dtype)\n",
        "    x = grad.to(torch.bfloat16)\n",
        ("tests/test_muon_ns_dtype.py::test_muon_matches_torch_in_bf16_and_float32_within_bf16_rounding",),
    ),
    Mutant(
        "estimate_ignores_compile", "the estimate counts eager autocast's activations for compiled blocks",
        "torchllm/tools/estimate_memory.py",
        '    compiled = cfg.compile.enable and "model" in cfg.compile.components and ac.mode == "none"',
        '    compiled = False',
        ("tests/test_estimate_memory_cuda.py::test_estimate_within_15_percent_of_the_h200_peaks",
         "tests/test_estimate_memory_cuda.py::test_compiled_and_float8_terms_count_what_the_partitioner_saves"),
    ),
    Mutant(
        "estimate_ignores_float8", "the estimate counts bf16 matmul inputs and weight copies under float8",
        "torchllm/tools/estimate_memory.py",
        '    float8 = compiled and cfg.float8.enable and cfg.float8.recipe == "tensorwise"',
        '    float8 = False',
        ("tests/test_estimate_memory_cuda.py::test_estimate_within_15_percent_of_the_h200_peaks",
         "tests/test_estimate_memory_cuda.py::test_compiled_and_float8_terms_count_what_the_partitioner_saves"),
    ),
    Mutant(
        "worker_error_not_recorded", "a worker's exception never reaches torchrun's error file "
        "(TORCHELASTIC_ERROR_FILE): @record dropped from the worker's build-and-train",
        "torchllm/run/process.py",
        "@record\ndef _build_and_train(",
        "def _build_and_train(",
        ("tests/test_launcher.py::test_an_error_on_rank_1_is_printed_once_on_rank_0s_console",),
    ),
    # --- issue 42 round 3 gaps: tokenizer identity at a DCP initial load, a Hub name against a
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
        "save_error_exit_code_not_4", "a checkpoint that cannot be saved (on_save_error = "
        "'stop') ends the process with exit code 1, as any crash, not 4",
        "torchllm/run/failures.py",
        "    if isinstance(exc, CheckpointSaveError):\n        return 4\n",
        "    if isinstance(exc, CheckpointSaveError):\n        return 1\n",
        ("tests/test_store_errors.py::test_a_refusing_store_is_a_save_error_not_a_traceback",
         "tests/test_store_errors.py::test_a_stalled_store_with_stop_exits_4_naming_the_url"),
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
        "lora_header_total_counts_frozen_only",
        "the run header's 'of N params' counts the frozen base only (not base + adapters)",
        "torchllm/models/lora.py",
        "    total = sum(p.numel() for p in model.parameters())",
        "    total = sum(p.numel() for p in model.parameters() if not p.requires_grad)",
        ("tests/test_lora.py::test_shipped_config_trains_adapters_only_resumes_exactly_and_exports",),
    ),
    Mutant(
        "lora_resume_mismatch_ignores_train_embeddings",
        "a resume with another lora.train_embeddings is not named (a generic shape error)",
        "torchllm/models/lora.py",
        "           for k in (\"enable\", \"rank\", \"target_modules\", \"train_embeddings\")}",
        "           for k in (\"enable\", \"rank\", \"target_modules\")}",
        ("tests/test_lora.py::test_resume_with_other_lora_settings_is_one_line_naming_the_key",),
    ),
    Mutant(
        "lora_resume_mismatch_off",
        "a resume under other [lora] settings never names the key (resume_mismatch finds nothing)",
        "torchllm/models/lora.py",
        "    if not old[\"lora.enable\"] and not new[\"lora.enable\"]:\n        return None",
        "    if True:\n        return None",
        ("tests/test_lora.py::test_resume_with_other_lora_settings_is_one_line_naming_the_key",),
    ),
    Mutant(
        "lora_tp_not_refused", "LoRA with tensor parallelism is not refused at the launcher",
        "torchllm/models/lora.py",
        "            (\"parallelism.tensor_parallel_degree\", dims.tp_enabled,",
        "            (\"parallelism.tensor_parallel_degree\", False,",
        ("tests/test_lora.py::test_lora_with_tp_pp_or_float8_stops_at_the_launcher[tp]",),
    ),
    Mutant(
        "lora_pp_not_refused", "LoRA with pipeline parallelism is not refused at the launcher",
        "torchllm/models/lora.py",
        "            (\"parallelism.pipeline_parallel_degree\", dims.pp_enabled,",
        "            (\"parallelism.pipeline_parallel_degree\", False,",
        ("tests/test_lora.py::test_lora_with_tp_pp_or_float8_stops_at_the_launcher[pp]",),
    ),
    Mutant(
        "lora_float8_not_refused", "LoRA with float8 is not refused at the launcher",
        "torchllm/models/lora.py",
        "    refused = [(\"float8.enable\", cfg.float8.enable,",
        "    refused = [(\"float8.enable\", False,",
        ("tests/test_lora.py::test_lora_with_tp_pp_or_float8_stops_at_the_launcher[float8]",),
    ),
    Mutant(
        "lora_peft_modules_to_save_dropped",
        "the PEFT adapter of a lora.train_embeddings run does not declare modules_to_save",
        "torchllm/hf/peft_names.py",
        "        \"modules_to_save\": saved or None,",
        "        \"modules_to_save\": None,",
        ("tests/test_lora.py::test_adapter_and_merged_exports_give_torchllm_logits[llama3_embeddings]",),
    ),
    Mutant(
        "lora_peft_modules_to_save_swapped",
        "the PEFT adapter saves the trained output head as embed_tokens and the table as lm_head",
        "torchllm/hf/peft_names.py",
        "    roots = {\"tok_embeddings\": \"model.embed_tokens\", \"output\": \"lm_head\"}",
        "    roots = {\"tok_embeddings\": \"lm_head\", \"output\": \"model.embed_tokens\"}",
        ("tests/test_lora.py::test_adapter_and_merged_exports_give_torchllm_logits[llama3_embeddings]",),
    ),
    Mutant(
        "hub_offline_imports_datasets", "going offline imports datasets (~4 s) for its switch",
        "torchllm/hub.py",
        "    datasets_config = sys.modules.get(\"datasets.config\")",
        "    import datasets.config as datasets_config",
        ("tests/test_offline.py::test_hub_offline_switch_does_not_import_datasets",),
    ),
    Mutant(
        "next_hellaswag_ignores_local_copy", "the end block's HellaSwag command downloads although "
        "eval.hellaswag_data is a local file", "torchllm/report/hook.py",
        "    if Path(hs).is_file():", "    if False:",
        ("tests/test_report.py::test_next_lines_use_the_runs_local_eval_copies",),
    ),
    Mutant(
        "next_downstream_wrong_flag", "the end block's downstream command passes the local copies "
        "with a flag the CLI does not have", "torchllm/report/hook.py",
        "                      f\"--data-dir {shlex.quote(cfg.eval.tasks_data_dir)}\")",
        "                      f\"--data {shlex.quote(cfg.eval.tasks_data_dir)}\")",
        ("tests/test_report.py::test_next_lines_use_the_runs_local_eval_copies",),
    ),
    Mutant(
        "sft_bench_oracle_drops_end_of_turn", "bench_sft_isolation scores a reply without its "
        "end-of-turn token (the trainer trains it)", "benchmarks/bench_sft_isolation.py",
        "        if inside:\n            out.append(t)",
        "        if inside and i != end:\n            out.append(t)",
        ("tests/test_chat_isolation.py::"
         "test_the_sft_isolation_benchmarks_oracle_trains_what_the_trainer_trains",),
    ),
    Mutant(
        "sft_tokens_seen_count_padding", "an SFT run's tokens seen (and tok/s, MFU) count the "
        "packing's padding as processed tokens", "torchllm/train.py",
        "        if self.chat_data and \"positions\" in batch:",
        "        if False:",
        ("tests/test_chat_isolation.py::"
         "test_run_train_sh_sft_config_loss_is_transformers_loss_of_each_conversation_alone",),
    ),
]


def by_name() -> dict[str, Mutant]:
    return {m.name: m for m in MUTANTS}


def stale(mutant: Mutant, root: Path = REPO) -> str | None:
    """Why the patch does not apply to the source under `root`, or None when it does."""
    path = root / mutant.path
    if not path.is_file():
        return f"{mutant.path} does not exist"
    count = path.read_text().count(mutant.old)
    if count != 1:
        return f"its snippet occurs {count} times in {mutant.path} (must be exactly once)"
    for test in mutant.tests:
        file, _, name = test.partition("::")
        source = (root / file).read_text() if (root / file).is_file() else ""
        if f"def {name.split('[')[0]}(" not in source:
            return f"test {test} does not exist"
    return None


def copy_tree(dest: Path) -> Path:
    """The working tree's tracked and untracked (not ignored) files, copied under dest/repo."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    root = dest / "repo"
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / rel)
    shared = REPO.parent / "shared"  # tests read data beside the checkout (conftest.SHARED)
    if shared.exists():
        (dest / "shared").symlink_to(shared)
    return root


def run_mutant(mutant: Mutant, timeout: int) -> tuple[str, str]:
    """('killed' | 'SURVIVED' | 'stale' | 'error', detail)."""
    why = stale(mutant)
    if why:
        return "stale", why
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        root = copy_tree(Path(tmp))
        path = root / mutant.path
        path.write_text(path.read_text().replace(mutant.old, mutant.new))
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               "-o", "addopts=", *mutant.tests]
        try:
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return "killed", f"tests timed out after {timeout}s (a hang counts as caught)"
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    if proc.returncode == 0:
        if " passed" not in tail[0]:
            return "error", f"no test ran: {tail[0]}"
        return "SURVIVED", tail[0]
    if proc.returncode == 1:
        return "killed", tail[0]
    return "error", f"pytest exit {proc.returncode}: {tail[0]}"  # collection/usage problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this mutant")
    parser.add_argument("--check-patches", action="store_true",
                        help="only check that every patch applies to the current source")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mutant's tests")
    args = parser.parse_args(argv)
    mutants = MUTANTS
    if args.only:
        unknown = sorted(set(args.only) - set(by_name()))
        if unknown:
            print(f"unknown mutant(s) {unknown}; known: {', '.join(by_name())}", file=sys.stderr)
            return 2
        mutants = [by_name()[n] for n in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name:34s} {m.path}: {m.what}")
            for test in m.tests:
                print(f"{'':34s}   guarded by {test}")
        return 0
    if args.check_patches:
        bad = [(m.name, why) for m in mutants if (why := stale(m))]
        for name, why in bad:
            print(f"stale  {name}: {why}")
        print(f"{len(mutants) - len(bad)}/{len(mutants)} patches apply")
        return 2 if bad else 0
    results = {}
    for m in mutants:
        t0 = time.perf_counter()
        status, detail = run_mutant(m, args.timeout)
        results[m.name] = status
        print(f"{status:8s} {m.name} ({time.perf_counter() - t0:.0f}s): {detail}", flush=True)
    survived = [n for n, s in results.items() if s == "SURVIVED"]
    broken = [n for n, s in results.items() if s in ("stale", "error")]
    print(f"{len(results) - len(survived) - len(broken)}/{len(results)} mutants killed"
          + (f"; survived: {', '.join(survived)}" if survived else "")
          + (f"; stale or errored: {', '.join(broken)}" if broken else ""))
    return 1 if survived else 2 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
