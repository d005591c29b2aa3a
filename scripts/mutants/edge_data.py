"""Mutants of issue 61's data edges: the data identity's reads (fingerprint), eval.fetch's swap,
a garbage tokenizer_config.json, non-regular files and outward links in a local: folder."""

from __future__ import annotations

from mutants.base import Mutant

READS = "tests/test_resume_data_reads.py::"
FETCH = "tests/test_eval_fetch_swap.py::"
FILES = "tests/test_data_file_edges.py::"

MUTANTS = [
    Mutant.at(
        "data_reads_not_recorded", "the checkpoint's data identity omits the settings that "
        "choose which tokens train and validate (text_column, val_fraction, validation.dataset)",
        "torchllm.data.fingerprint:data_fingerprint",
        ',\n            "reads": reads(dcfg, vcfg)}', "}",
        (READS + "test_a_resume_reading_other_tokens_is_refused_naming_the_key",),
    ),
    Mutant.at(
        "data_reads_older_record_refused", "a checkpoint written before `reads` counts every "
        "recorded setting as changed (its resume is refused)",
        "torchllm.data.fingerprint:changes",
        "    if isinstance(was, dict):  # absent: a record from before `reads`, not compared\n"
        "        out += [f\"{key} {was.get(key)!r} -> {now_reads.get(key)!r}\" for key in READS\n"
        "                if key in was and was[key] != now_reads.get(key)]",
        "    was = was or {}\n"
        "    out += [f\"{key} {was.get(key)!r} -> {now_reads.get(key)!r}\" for key in READS\n"
        "            if was.get(key) != now_reads.get(key)]",
        (READS + "test_a_record_from_before_reads_is_not_compared",),
    ),
    Mutant.at(
        "data_reads_validation_as_written", "validation.dataset = data.dataset (the held-out "
        "split, as before) is recorded as written: a resume naming it is refused",
        "torchllm.data.fingerprint:reads",
        '    if not dedicated_validation(dcfg, vcfg):\n        out["validation.dataset"] = ""\n',
        "",
        (READS + "test_the_same_reads_resume",),
    ),
    Mutant.at(
        "fetch_keeps_the_other_form", "eval.fetch replaces only a copy of the same form: a new "
        "copa.jsonl beside an older copa/ (which the evals read first)",
        "torchllm.eval.fetch:install",
        '        for old in (out / name, out / f"{name}.jsonl"):',
        "        for old in (out / new.name,):",
        (FETCH + "test_a_file_fetched_over_an_older_folder_is_what_the_evals_read",
         FETCH + "test_a_hub_fetch_over_an_older_file_replaces_it_and_a_failed_one_keeps_it"),
    ),
    Mutant.at(
        "fetch_clears_before_writing", "eval.fetch deletes the older copy before the new one is "
        "written: a fetch failing midway leaves none",
        "torchllm.eval.fetch:from_hub",
        "    staging = staging_folder(out, task)\n",
        "    for old in (out / local_name(task), out / f\"{local_name(task)}.jsonl\"):\n"
        "        shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)\n"
        "    staging = staging_folder(out, task)\n",
        (FETCH + "test_a_hub_fetch_over_an_older_file_replaces_it_and_a_failed_one_keeps_it",),
    ),
    Mutant.at(
        "tokenizer_config_unchecked", "a tokenizer_config.json is parsed as is: garbage is a "
        "JSONDecodeError / AttributeError naming no file",
        "torchllm.data.tokenizer_json:HFTokenizer.__init__",
        "config, template_file = read_config(cfg_file), cfg_file",
        "config, template_file = json.loads(cfg_file.read_text()), cfg_file",
        (FILES + "test_a_garbage_tokenizer_config_is_one_line_naming_it",),
    ),
    Mutant.at(
        "local_reads_a_fifo", "a local: source takes whatever is not a folder: a FIFO in the "
        "folder is opened (the reader blocks on it)",
        "torchllm.data.sources.local:local_files",
        "        if not stat.S_ISREG(mode):", "        if stat.S_ISDIR(mode):",
        (FILES + "test_a_fifo_in_a_local_folder_is_named_and_never_opened",),
    ),
    Mutant.at(
        "local_follows_links_out", "a link in a local: folder is followed wherever it leads",
        "torchllm.data.sources.local:folder_files",
        "            if entry.is_symlink() and not", "            if False and not",
        (FILES + "test_a_link_leading_out_of_a_local_folder_is_refused_naming_it",),
    ),
]
