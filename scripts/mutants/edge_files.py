"""Mutants of the confined edges (issue 61, files): the report, a step's entries, step folder
names and the run folder's writes (scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

T = "tests/test_edge_files.py::"
REFUSED = T + "test_the_report_refuses_a_link_fifo_or_huge_file_in_the_run_folder"

MUTANTS = [
    Mutant.at(
        "report_writes_through_a_planted_temp_link",
        "the report writes report.md through a fixed temp name with a plain write_text, which "
        "follows a link planted there (a .pth file in site-packages runs code at the next start)",
        "torchllm.report:write_report",
        "    return Path(store.write_text(name(REPORT), text)), figures\n",
        "    path = Path(store.where(name(REPORT)))\n"
        "    tmp = path.with_suffix('.md.tmp')\n"
        "    tmp.write_text(text)\n"
        "    tmp.replace(path)\n"
        "    return path, figures\n",
        (T + "test_the_report_writes_through_no_planted_link",),
    ),
    Mutant.at(
        "report_header_verbatim",
        "run.json's header goes into report.md as it is: its lines start lines of the report "
        "(markdown, an `import` line)",
        "torchllm.report.markdown:render_markdown",
        '"", code_block(header_text(run)), ""]',
        '"", header_text(run), ""]',
        (T + "test_the_report_escapes_the_text_it_takes_from_the_run_folder",),
    ),
    Mutant.at(
        "report_reads_follow_links",
        "the report reads the run folder's files by path: a link (another run's config, a file "
        "anywhere) is followed, a FIFO blocks, a huge file is read whole",
        "torchllm.report.events:read_if_there",
        "        data = store.read_bytes(name, max_bytes=MAX_BYTES)\n",
        "        path = store.root / name\n"
        "        if not path.is_file():\n"
        "            return None\n"
        "        data = path.read_bytes()\n",
        (f"{REFUSED}[_link_config]", f"{REFUSED}[_link_info]", f"{REFUSED}[_huge_info]"),
    ),
    Mutant.at(
        "run_json_written_through_a_link",
        "the report hook writes run.json through a temp file `report/run.tmp` opened by path, "
        "following a link planted there",
        "torchllm.report.hook:RunReport._write_info",
        "            self.store.write_text(INFO_NAME, json.dumps(info, indent=1))\n",
        "            tmp = self.run_dir / 'report' / 'run.tmp'\n"
        "            tmp.parent.mkdir(parents=True, exist_ok=True)\n"
        "            tmp.write_text(json.dumps(info, indent=1))\n"
        "            tmp.replace(self.run_dir / INFO_NAME)\n",
        (T + "test_a_runs_own_writes_follow_no_planted_link",),
    ),
    Mutant.at(
        "write_durably_follows_a_temp_link",
        "LocalStorage.write_durably opens its temp file with a plain open(): a link planted at "
        "`.config.toml.tmp` in the run folder is written through",
        "torchllm.storage:create_new",
        "    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW\n",
        "    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)\n"
        "    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW\n",
        (T + "test_a_runs_own_writes_follow_no_planted_link",),
    ),
    Mutant.at(
        "lock_temp_written_through_a_link",
        "the run lock's temp file (run.lock.new.<host>.<pid>) is written with write_text, "
        "following a link planted at that name",
        "torchllm.run.runlock:RunLock._create",
        "        with os.fdopen(create_new(tmp), \"w\") as f:",
        "        with open(tmp, \"w\") as f:",
        (T + "test_a_runs_own_writes_follow_no_planted_link",),
    ),
    Mutant.at(
        "step_entries_unchecked",
        "a step's entries are not checked when it is opened: a FIFO among them is ignored, and "
        "a linked shard is only caught by the checksums (a resume falls back past it)",
        "torchllm.checkpoint.step:read_step_folder",
        '        if kind not in ("file", "folder"):\n',
        '        if kind not in ("file", "folder", "link", "fifo"):\n',
        (T + "test_hf_export_refuses_a_step_holding_a_link_or_fifo[add_a_fifo]",
         T + "test_a_resume_stops_at_a_step_holding_a_link_without_falling_back"),
    ),
    Mutant.at(
        "step_names_any_digits",
        "step folder names parsed with \\d+: step-04, step-004 and step-٤ mean step 4, and the "
        "resume's cleanup deletes the complete step-4 for the empty one",
        "torchllm.checkpoint.layout:_STEP_DIR",
        'r"step-(0|[1-9][0-9]*)", re.ASCII',
        'r"step-(\\d+)"',
        (T + "test_a_resume_ignores_step_folders_whose_names_are_not_canonical",),
    ),
]
