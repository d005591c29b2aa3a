"""Mutants of Hugging Face import/export, PEFT adapters (scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

MUTANTS = [
    Mutant.at(
        "export_mode_0600", "exported .safetensors keep safetensors' 0600 mode",
        "torchllm.hf.files:save_safetensors", "    os.chmod(path, file_mode())\n", "",
        ("tests/test_hf_export.py::"
         "test_export_files_follow_the_umask_and_are_replaced_only_with_overwrite",),
    ),
    Mutant.at(
        "output_replaced", "convert to-file / to-dcp silently replace an existing output",
        "torchllm.hf.files:refuse_existing", "    if out.exists() and not overwrite:\n",
        "    if False:\n",
        ("tests/test_hf_export.py::"
         "test_export_files_follow_the_umask_and_are_replaced_only_with_overwrite",),
    ),
    Mutant.at(
        "export_without_chat_template", "the export writes no chat_template for a chat run",
        "torchllm.hf.tokenizer:write_tokenizer",
        '        config["chat_template"], end_of_turn = found\n',
        "        end_of_turn = found[1]\n",
        ("tests/test_hf_tokenizer_export.py::"
         "test_chat_template_in_the_export_gives_the_runs_chat_ids",),
    ),
    Mutant.at(
        "export_skips_checksums",
        "hf export resolves the checkpoint without checking it (a flipped byte exports)",
        "torchllm.hf.export:_opened",
        "else open_checkpoint(checkpoint)",
        "else Step.find(checkpoint)",
        ("tests/test_checkpoint_trust.py::test_generate_and_export_refuse_a_flipped_byte",),
    ),
    Mutant.at(
        "hf_import_bad_safetensors_unnamed",
        "hf import of a bad .safetensors prints safetensors' error without the file",
        "torchllm.hf.folder:read_hf_weights",
        "        except Exception as e:  # noqa: BLE001 - SafetensorError: truncated, empty, not "
        "one\n",
        "        except ImportError as e:\n",
        ("tests/test_hf_export.py::"
         "test_import_of_a_truncated_garbage_or_empty_safetensors_names_the_file",),
    ),
    Mutant.at(
        "hf_initial_load_tokenizer_unchecked", "initial_load_in_hf accepts another tokenizer "
        "than the folder's", "torchllm.hf.load:load_initial_weights",
        '    check_same_tokenizer(hf_record(hf_dir), tokenizer,\n',
        '    (hf_record(hf_dir), tokenizer,\n',
        ("tests/test_stage_tokenizer.py::"
         "test_a_stage_from_a_hugging_face_export_keeps_its_tokenizer",),
    ),
    Mutant.at(
        "hf_import_seed_without_tokenizer", "hf import writes a seed with no config.toml and no "
        "tokenizer", "torchllm.hf.load:import_hf",
        "    save_seed_checkpoint(weights, out, step, seed_files)\n",
        "    save_seed_checkpoint(weights, out, step)\n",
        ("tests/test_stage_tokenizer.py::"
         "test_hf_import_writes_a_seed_that_generates_and_passes_its_tokenizer_on",),
    ),
    Mutant.at(
        "lora_b_not_permuted", "the PEFT export leaves lora_B of wq/wk in torchllm's RoPE layout",
        "torchllm.models.llama.hf:LlamaAdapter.peft_lora_b",
        "        if module in (\"attention.wq\", \"attention.wk\"):\n",
        "        if False:\n",
        ("tests/test_lora.py::test_adapter_and_merged_exports_give_torchllm_logits[llama3]",),
    ),
    Mutant.at(
        "generation_config_without_sampling", "the export's generation_config.json leaves out the run's sampling defaults",
        "torchllm.hf.export:generation_config",
        '    gen["max_new_tokens"] = sampling.max_new_tokens',
        '    pass',
        ("tests/test_hf_export.py::test_export_writes_a_generation_config_transformers_follows",),
    ),
    Mutant.at(
        "lora_peft_modules_to_save_dropped",
        "the PEFT adapter of a lora.train_embeddings run does not declare modules_to_save",
        "torchllm.hf.peft_names:adapter_config",
        "        \"modules_to_save\": saved or None,",
        "        \"modules_to_save\": None,",
        ("tests/test_lora.py::test_adapter_and_merged_exports_give_torchllm_logits[llama3_embeddings]",),
    ),
    Mutant.at(
        "lora_peft_modules_to_save_swapped",
        "the PEFT adapter saves the trained output head as embed_tokens and the table as lm_head",
        "torchllm.models.hf_common:LLAMA_LIKE_ROOTS",
        "LLAMA_LIKE_ROOTS = {\"tok_embeddings\": \"model.embed_tokens\", \"output\": \"lm_head\"}",
        "LLAMA_LIKE_ROOTS = {\"tok_embeddings\": \"lm_head\", \"output\": \"model.embed_tokens\"}",
        ("tests/test_lora.py::test_adapter_and_merged_exports_give_torchllm_logits[llama3_embeddings]",),
    ),
    Mutant.at(
        "peft_export_of_a_family_without_names",
        "--adapter on a family without PEFT names is not refused up front (a KeyError mid-export)",
        "torchllm.hf.peft_names:peft_adapter",
        "    if adapter.peft_block is None:\n",
        "    if False:\n",
        ("tests/test_model_contract.py::"
         "test_peft_names_come_from_each_family_adapter_and_hf_names_no_family",),
    ),
    Mutant.at(
        "lora_peft_token_rows_as_delta",
        "the adapter stores the trained rows' change, where PEFT's trainable_tokens_delta "
        "replaces the rows",
        "torchllm.hf.peft_names:peft_weights",
        "values = table[ids[0]: ids[-1] + 1] + weights[key].to(table.dtype)",
        "values = weights[key].to(table.dtype)",
        ("tests/test_lora_tokens.py::"
         "test_adapter_export_loads_in_peft_on_its_base_and_on_the_base_run_resized",),
    ),
    Mutant.at(
        "lora_adapter_base_path_absolute",
        "adapter_config.json names the base by an absolute path (moving the folder breaks it)",
        "torchllm.hf.peft_names:adapter_config",
        "        \"base_model_name_or_path\": BASE,",
        "        \"base_model_name_or_path\": str(__import__(\"pathlib\").Path(BASE).absolute()),",
        ("tests/test_lora_tokens.py::"
         "test_adapter_export_loads_in_peft_on_its_base_and_on_the_base_run_resized",),
    ),
    Mutant.at(
        "hf_import_quantization_ignored",
        "hf import casts a quantized (FP8 block-scaled) folder's values, dropping its scales",
        "torchllm.hf.validate:check_hf_config",
        "    if quant is not None:\n",
        "    if False:\n",
        ("tests/test_hf_import_checks.py::test_a_quantized_folder_is_refused",),
    ),
    Mutant.at(
        "hf_import_any_dtype",
        "hf import casts int8 / bool / fp8 tensors to the seed's float dtype",
        "torchllm.hf.validate:check_tensors",
        "        if tensor.dtype not in FLOAT_DTYPES:\n",
        "        if False:\n",
        ("tests/test_hf_import_checks.py::test_a_non_float_tensor_is_refused[dtype0]",
         "tests/test_hf_import_checks.py::test_a_non_float_tensor_is_refused[dtype1]"),
    ),
    Mutant.at(
        "hf_import_nan_accepted", "hf import writes NaN / inf weights into the seed",
        "torchllm.hf.validate:check_tensors",
        "        if not torch.isfinite(tensor).all():\n            bad =",
        "        if False:\n            bad =",
        ("tests/test_hf_import_checks.py::test_non_finite_weights_are_refused[nan]",
         "tests/test_hf_import_checks.py::test_non_finite_weights_are_refused[inf]"),
    ),
    Mutant.at(
        "hf_import_unknown_tensors_dropped",
        "hf import silently drops tensors the model has no place for",
        "torchllm.hf.load:convert_from_hf",
        "    check_all_read(weights, hf_dir.root)\n", "",
        ("tests/test_hf_import_checks.py::test_unknown_tensors_are_refused",),
    ),
    Mutant.at(
        "hf_import_shapes_unchecked",
        "hf import writes a wrong-shape tensor (and pads a 3,000,000 vocab from 512 rows)",
        "torchllm.hf.load:convert_from_hf",
        "    check_shapes(weights, expected_shapes(adapter, args, vocab), hf_dir.root, vocab)\n",
        "",
        ("tests/test_hf_import_checks.py::test_a_wrong_shape_is_refused_before_the_seed_is_written",
         "tests/test_hf_import_checks.py::test_vocab_size_must_equal_the_embedding_rows[500]"),
    ),
    Mutant.at(
        "hf_import_vocab_type_unchecked",
        "hf import takes a negative or string vocab_size to a traceback",
        "torchllm.hf.validate:check_hf_config",
        "    if type(vocab) is not int or vocab < 1:",
        "    if vocab is None:",
        ("tests/test_hf_import_checks.py::test_vocab_size_must_be_a_positive_integer[-5]",
         "tests/test_hf_import_checks.py::test_vocab_size_must_be_a_positive_integer[512]"),
    ),
    Mutant.at(
        "hf_import_cast_overflow", "hf import --dtype float16 writes inf for large weights",
        "torchllm.hf.load:import_hf",
        "    check_cast(weights, dtype, hf_dir.root)  # before anything is written\n", "",
        ("tests/test_hf_import_checks.py::test_a_cast_that_overflows_the_dtype_is_refused",),
    ),
    Mutant.at(
        "hf_import_relative_tokenizer", "hf import --out REL records a relative tokenizer path",
        "torchllm.hf.load:_seed_tokenizer",
        "tokenizer=str(out.absolute() / found[0].name))",
        "tokenizer=str(out / found[0].name))",
        ("tests/test_hf_import_checks.py::test_a_relative_out_records_an_absolute_tokenizer_path",),
    ),
    Mutant.at(
        "hf_import_config_types_unchecked",
        "hf import of a config.json with rope_theta = \"1e6\" is a TypeError traceback",
        "torchllm.hf.validate:check_hf_config",
        "        if value is not None and (type(value) not in (int, float) or not math.isfinite(value)):",
        "        if False:",
        ("tests/test_hf_import_checks.py::test_other_bad_config_values_are_one_line[str]",),
    ),
]
