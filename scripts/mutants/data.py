"""Mutants of data: sources, packing, chat, mixtures, tokenizers, prepare (scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

MUTANTS = [
    Mutant.at(
        "prepare_pool_of_one", "prepare --workers 1 (the default on 2 cores) starts a spawned "
        "tokenizer process that only takes turns with the main one (~2 CPU-s of imports)",
        "torchllm.data.prepare:_prepare",
        "        if workers > 1:\n",
        "        if workers >= 1:\n",
        ("tests/test_prepare_split.py::test_default_split_is_proportional_whole_documents",),
    ),
    Mutant.at(
        "loader_draws_global_rng",
        "iter(train loader) draws its worker seed from the global torch RNG after a restore",
        "torchllm.data.loader:TrainLoader.__init__",
        "                      generator=torch.Generator().manual_seed(0))",
        "                      )",
        ("tests/test_checkpoint.py::test_split_run_equals_straight_run_bit_for_bit",),
    ),
    Mutant.at(
        "prepare_in_place", "prepare writes its shards straight into --out (no swap at the end)",
        "torchllm.data.prepare:prepare",
        "        index = _prepare(dcfg, tokenizer_spec, tmp, shard_tokens,",
        "        index = _prepare(dcfg, tokenizer_spec, out, shard_tokens,",
        ("tests/test_data_safety.py::"
         "test_prepare_into_a_used_folder_keeps_the_old_shards_until_it_succeeds",),
    ),
    Mutant.at(
        "unlisted_shard_read", "training ignores shard files index.json does not list",
        "torchllm.data.sources.shards:open_split",
        "        if SHARD_FILE.fullmatch(name) and name not in listed:",
        "        if False:",
        ("tests/test_data_safety.py::test_training_refuses_a_shard_not_listed_in_the_index",),
    ),
    Mutant.at(
        "sft_without_targets", "chat data with no assistant turn trains (loss nan, 0 tokens)",
        "torchllm.data.packing.chat:build_chat_source", "    if not mask[: source.windows_per_epoch, 1:].any():",
        "    if False:",
        ("tests/test_data_safety.py::test_sft_data_without_an_assistant_turn_stops_at_start",),
    ),
    Mutant.at(
        "mixture_stream_position_lost",
        "a resumed mixture restores its batch count but not its streamed sources' positions",
        "torchllm.data.mixture:MixtureBatches.load_state_dict", "            src.load_state_dict(state[\"streams\"][s])\n",
        "            pass\n",
        ("tests/test_data_kinds.py::test_a_mixture_with_a_stream_resumes_exactly",),
    ),
    Mutant.at(
        "tokenizer_paragraphs_only",
        "the tokenizer trainer gets blank-line paragraphs (long ones are silently skipped)",
        "torchllm.data.tokenizer_training:train_sentencepiece.chunks", "            for chunk in training_chunks(text):\n",
        "            for chunk in text.split(\"\\n\\n\"):\n",
        ("tests/test_tokenizer_text.py::test_nothing_is_silently_dropped",
         "tests/test_tokenizer_text.py::test_the_train_cli_on_a_single_real_shaped_file"),
    ),
    Mutant.at(
        "chat_mask_past_end_of_turn",
        "a Jinja template's loss mask also trains what follows the end-of-turn token",
        "torchllm.data.chat.jinja:JinjaChat.render",
        "                trained[k] = last is None or k <= last\n",
        "                trained[k] = True\n",
        ("tests/test_chat_template.py::"
         "test_own_template_renders_like_transformers_and_masks_the_assistant_turns",),
    ),
    Mutant.at(
        "ran_out_every_epoch", "a mixture source logs every epoch it runs out",
        "torchllm.data.mixture:MixtureBatches.window_id", "                if self.rollovers[s] == 1:\n",
        "                if self.rollovers[s] >= 1:\n",
        ("tests/test_header_fixes.py::test_a_source_that_runs_out_every_step_says_so_once",),
    ),
    Mutant.at(
        "bytes_prefix_space", "the bytes tokenizer adds a space before each text (ids shift)",
        "torchllm.data.byte_tokenizer:byte_level_tokenizer", "ByteLevel(add_prefix_space=False, use_regex=True)",
        "ByteLevel(add_prefix_space=True, use_regex=True)",
        ("tests/test_hf_tokenizer_export.py::test_bytes_tokenizer_is_utf8_bytes_and_exports_with_"
         "the_same_ids",),
    ),
    Mutant.at(
        "chat_hub_read_whole", "chat:hf:NAME conversations are read whole at start, not streamed",
        "torchllm.data.packing.chat:ChatPacking.windows", "        if ds.source.streams:\n", "        if False:\n",
        ("tests/test_chat_stream.py::test_a_chat_hub_dataset_is_streamed_not_read_whole",
         "tests/test_chat_stream.py::test_a_chat_stream_serves_whole_conversations_in_stream_order"),
    ),
    Mutant.at(
        "chat_stream_mask_not_restored", "a resumed chat stream loses the loss mask of its "
        "unbatched tokens", "torchllm.data.sources.hf:StreamWindows.load_state_dict",
        "    def load_state_dict(self, state: dict) -> None:\n        self.state = state\n",
        "    def load_state_dict(self, state: dict) -> None:\n        self.state = {**state, "
        "**({'trained': [True] * len(state['trained'])} if 'trained' in state else {})}\n",
        ("tests/test_chat_stream.py::test_a_text_and_chat_stream_mixture_resumes_exactly",),
    ),
    Mutant.at(
        "remote_shards_read_whole",
        "a shard object on a store is fetched whole for every window (not its byte range)",
        "torchllm.data.token_stream:RangeReads.__getitem__",
        "        data = self.storage.read_range(self.part.path, base + lo * self.itemsize,\n"
        "                                       base + hi * self.itemsize)\n"
        "        return np.frombuffer(data, dtype=self.part.dtype)\n",
        "        data = self.storage.read_range(self.part.path, base,\n"
        "                                       base + self.part.length * self.itemsize)\n"
        "        return np.frombuffer(data, dtype=self.part.dtype)[lo:hi]\n",
        ("tests/test_object_storage.py::test_shards_on_a_bucket_train_the_same_batches_as_on_"
         "disk",),
    ),
    Mutant.at(
        "remote_shards_header_as_tokens",
        "ranged reads of a shard object start at the file's first byte, not after the header",
        "torchllm.data.token_stream:RangeReads.__getitem__",
        "        base = self.part.offset\n",
        "        base = 0\n",
        ("tests/test_object_storage.py::test_shards_on_a_bucket_train_the_same_batches_as_on_"
         "disk",),
    ),
    Mutant.at(
        "local_data_not_preflighted", "the launcher's pre-flight check does not look for local files",
        "torchllm.data.sources.local:LocalFiles.preflight",
        "        local_files(self.location)  # a missing file",
        "        pass  # a missing file",
        ("tests/test_run_safety.py::test_launcher_config_error_is_one_line_before_torchrun",),
    ),
    Mutant.at(
        "prepare_val_takes_big_documents_whole",
        "prepare gives validation a whole document whenever it is behind its fraction, counting "
        "the document first (one big document makes most of the corpus validation)",
        "torchllm.data.prepare:ValSplit.take",
        "        if n <= max(room, self.WHOLE_DOCUMENT):\n",
        "        if True:\n",
        ("tests/test_prepare_split.py::test_a_big_document_cannot_swell_the_validation_split",),
    ),
    Mutant.at(
        "chat_packing_explicit_causal_accepted",
        "an explicit causal mask with packed conversations trains silently",
        "torchllm.data.packing.chat:check_independent",
        '    if mask != "block_causal" or not restart:\n        key = (',
        '    if False:\n        key = (',
        ("tests/test_chat_isolation.py::test_packed_conversations_train_as_if_each_were_alone",),
    ),
    Mutant.at(
        "chat_llama3_header_newlines_apart",
        "Llama 3's header \"\\n\\n\" tokenized apart from the content (a reply starting with "
        "\"\\n\" gets 271, 198 where apply_chat_template gives 1432)",
        "torchllm.data.chat.template:ChatTemplate.render",
        '                head = head[: -len(self.tokenizer.encode("\\n\\n"))]\n'
        '                body = self.tokenizer.encode("\\n\\n" + content)\n',
        '                body = self.tokenizer.encode(content)\n',
        ("tests/test_chat_template.py::test_every_tokenizer_kind_renders_36_conversations_"
         "like_transformers[tiktoken-llama3]",),
    ),
    Mutant.at(
        "chat_jinja_mask_by_token_start",
        "a template's token that merges the header's end with the reply's start is not a target "
        "(transformers' assistant mask counts it)",
        "torchllm.data.chat.jinja:JinjaChat.render",
        "            inside = [k for k, (s, e) in enumerate(offsets) if s < end and e > start]",
        "            inside = [k for k, (s, e) in enumerate(offsets) if start <= s < end]",
        ("tests/test_chat_template.py::test_every_tokenizer_kind_renders_36_conversations_"
         "like_transformers[tokenizer.json-llama3-split]",),
    ),
    Mutant.at(
        "local_text_bom_kept",
        "a UTF-8 byte-order mark starting a local .txt file is read as text",
        "torchllm.data.sources.local:LocalFiles.open_rows",
        '            kwargs["encoding"] = "utf-8-sig"',
        '            kwargs["encoding"] = "utf-8"',
        ("tests/test_local_text_bom.py::test_a_bom_starting_a_local_text_file_is_not_read",),
    ),
    Mutant.at(
        "single_document_note_missing", "a one-file corpus gives its end to validation without a word",
        "torchllm.data.sources.base:CorpusSource.token_split",
        "        if len(starts) == 1 and held_out:",
        "        if False:",
        ("tests/test_data_kinds.py::test_a_single_file_corpus_says_its_end_is_the_validation_split",),
    ),
    Mutant.at(
        "prepare_disk_full_traceback",
        "prepare on a full disk ends in a traceback",
        "torchllm.data.prepare:main",
        "        if e.errno != errno.ENOSPC:\n",
        "        if True:\n",
        ("tests/test_store_errors.py::test_prepare_on_a_full_disk_is_one_line",),
    ),
    Mutant.at(
        "data_fingerprint_ignores_tokens",
        "the data fingerprint records the sources' names only: re-prepared shards resume at the "
        "old position",
        "torchllm.data.fingerprint:data_fingerprint",
        '    content = parse_data(dcfg).content_identity()\n',
        '    content = ["stream" for _ in sources]\n',
        ("tests/test_resume_trust.py::test_resume_with_changed_data_says_what_changed_and_restarts_or_refuses[corpus]",),
    ),
    Mutant.at(
        "chat_padding_counted_as_processed", "a packed chat batch's padding counts as tokens processed",
        "torchllm.data.packing.chat:unpadded_tokens",
        "    return (positions > 0).sum() + starts.sum()",
        "    return positions.numel()",
        ("tests/test_data_chat.py::test_unpadded_tokens_count_conversation_inputs_not_padding",),
    ),
    Mutant.at(
        "inference_trains_the_tokenizer", "generate / evals / export train an 'auto' tokenizer "
        "a checkpoint lacks (on whatever data its config names)", "torchllm.data:_tokenizer_file",
        "    if not train:\n        if not path.is_file():\n",
        "    if False:\n        if not path.is_file():\n",
        ("tests/test_stage_tokenizer.py::"
         "test_generate_never_trains_a_missing_tokenizer_nor_takes_another",),
    ),
    Mutant.at(
        "corpus_documents_without_eos",
        "an in-memory text source packs its documents without their EOS token",
        "torchllm.data.sources.base:CorpusSource.token_split",
        "            tokenizer.encode(text, bos=True, eos=True) for text in self.texts()\n",
        "            tokenizer.encode(text, bos=True, eos=False) for text in self.texts()\n",
        ("tests/test_data_howto.py::test_a_toy_source_packs_its_documents_into_the_windows",),
    ),
    Mutant.at(
        "local_content_by_name_only",
        "local: and chat: files are identified by their path, not their content",
        "torchllm.data.sources.local:LocalFiles.content_identity",
        "        return files_identity(local_files(self.location))",
        "        return \"files:\" + self.location",
        ("tests/test_identity_trust.py::test_a_same_length_edit_of_the_corpus_is_refused_at_resume",
         "tests/test_identity_trust.py::test_a_changed_chat_file_is_refused_at_resume"),
    ),
    Mutant.at(
        "shards_tokenizer_by_size_only",
        "shards accept any tokenizer of their vocabulary size",
        "torchllm.data.sources.shards:Shards.check_vocab",
        "        if saved and saved != now:",
        "        if False:",
        ("tests/test_identity_trust.py::test_shards_of_one_tokenizer_refuse_another_of_the_same_size",),
    ),
    Mutant.at(
        "chat_template_no_time_limit",
        "a chat template with nested range(100000) loops renders forever (no time limit)",
        "torchllm.data.chat.limits:limited",
        "            _WATCHDOG.start(seconds)\n",
        "            pass\n",
        ("tests/test_chat_template_limits.py::test_a_template_that_never_finishes_is_stopped_by_the_time_limit",),
    ),
    Mutant.at(
        "chat_template_no_size_limit",
        "a chat template's output grows without limit",
        "torchllm.data.chat.limits:limited",
        "                if size > max_chars:\n",
        "                if False:\n",
        ("tests/test_chat_template_limits.py::test_a_template_with_large_output_is_stopped_by_the_size_limit",),
    ),
    Mutant.at(
        "chat_template_operators_unchecked",
        "`'x' * 10**9` in a chat template builds a gigabyte in one C call",
        "torchllm.data.chat.bounded:BoundedEnvironment",
        "    intercepted_binops = frozenset([\"*\", \"**\", \"+\", \"%\"])\n",
        "    intercepted_binops = frozenset()\n",
        ("tests/test_chat_template_limits.py::test_one_operator_building_a_huge_value_is_refused[pow]",
         "tests/test_chat_template_limits.py::test_one_operator_building_a_huge_value_is_refused[str]",),
    ),
    Mutant.at(
        "row_text_not_string_unchecked",
        "a null / non-string text in .jsonl or .parquet reaches the tokenizer (a TypeError)",
        "torchllm.data.sources.rows:stream_texts",
        "        if text and not isinstance(value, str):\n",
        "        if False:\n",
        ("tests/test_data_row_errors.py::test_a_jsonl_row_whose_text_is_not_a_string_is_named_by_file_and_line[null]",
         "tests/test_data_row_errors.py::test_a_parquet_row_whose_text_is_null_is_named_by_file_and_row"),
    ),
    Mutant.at(
        "row_text_file_unnamed", "a non-string text is named by its row number, not file and line",
        "torchllm.data.sources.rows:not_text",
        "    place = (find(column) if find else None) or f\"row {index}\"\n",
        "    place = f\"row {index}\"\n",
        ("tests/test_data_row_errors.py::test_a_jsonl_row_whose_text_is_not_a_string_is_named_by_file_and_line[int]",),
    ),
    Mutant.at(
        "empty_chat_named_local", "an empty chat: file is reported as local:",
        "torchllm.data.sources.local:LocalFiles.open_rows",
        "        return load_streaming(builder, kwargs, spec or self.spec, column,\n",
        "        return load_streaming(builder, kwargs, f\"local:{self.location}\", column,\n",
        ("tests/test_data_row_errors.py::test_an_empty_chat_file_is_named_as_chat[empty]",),
    ),
]
