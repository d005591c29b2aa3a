"""Mutants of the launcher, run folder and lock, stopping (scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

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
    Mutant.at(
        "time_limit_ignored", "training.time_limit_minutes never stops the run",
        "torchllm.run.stopping:StopConditions.reason",
        "            if elapsed + 2 * slowest_step + 60 > 60 * tcfg.time_limit_minutes:",
        "            if False:",
        ("tests/test_train.py::test_time_limit_saves_and_stops_before_the_limit",),
    ),
    Mutant.at(
        "ranks_stop_alone", "a rank that gets SIGTERM stops without telling the others",
        "torchllm.run.stopping:StopConditions.reason",
        "        if any_rank(reason is not None, self.device) and reason is None:",
        "        if False:",
        ("tests/test_checkpoint_dist.py::test_sigterm_on_one_rank_stops_both_at_the_same_step",),
    ),
    Mutant.at(
        "lock_takeover_unverified", "a stale-lock takeover renames aside whatever run.lock is "
        "by then (another launch's new lock), so two launches both hold the run folder",
        "torchllm.run.runlock:RunLock._take_over",
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
    Mutant.at(
        "zombie_holds_the_lock", "an exited, unreaped process (a zombie: its pid still answers) "
        "counts as the live holder of a run folder, which then can never be resumed",
        "torchllm.run.runlock:pid_alive",
        '    if fields is not None and fields[0] in ("Z", "X"):\n',
        "    if False:\n",
        ("tests/test_runlock.py::test_a_lock_held_by_a_zombie_is_taken_over",),
    ),
    Mutant.at(
        "one_process_through_torchrun", "NGPU=1 still starts torchrun's agent and a second "
        "interpreter (torch and torchllm imported again) instead of training in the launcher",
        "torchllm.run.launch:main",
        "    if _world_size(args) == 1 and not args.max_restarts:\n",
        "    if False:\n",
        ("tests/test_launch_path.py::test_one_process_trains_in_the_launchers_process_and_"
         "sigterm_saves_and_exits_0",),
    ),
    Mutant.at(
        "one_process_sees_the_launchers_argv", "the trainer run in the launcher's process sees "
        "the launcher's sys.argv (torchrun options, `--`) instead of its own",
        "torchllm.run.launch:run_in_process",
        "    launcher_argv, sys.argv = sys.argv, [worker.__file__, *train_args]\n",
        "    launcher_argv = sys.argv\n",
        ("tests/test_launch_path.py::test_one_process_trains_in_the_launchers_process_and_"
         "sigterm_saves_and_exits_0",),
    ),
    Mutant.at(
        "one_process_stop_unreported", "a one-process run stopped by SIGTERM exits 0 without the "
        "launcher's line saying it saved and stopped",
        "torchllm.run.launch:run_in_process",
        "    if code == 0 and signum is not None:\n",
        "    if False:\n",
        ("tests/test_launch_path.py::test_one_process_trains_in_the_launchers_process_and_"
         "sigterm_saves_and_exits_0",),
    ),
    Mutant.at(
        "killed_rank_without_its_signal", "a rank killed by a signal is reported with torchrun's "
        "raw negative exit code instead of the signal's name",
        "torchllm.run.launch:_how",
        "    if failure.exitcode < 0:\n        try:\n",
        "    if False:\n        try:\n",
        ("tests/test_launch_path.py::test_two_ranks_are_torchrun_workers_and_a_killed_rank_1_is_"
         "named_with_its_signal",),
    ),
    Mutant.at(
        "plain_launch_static_rendezvous", "a one-node launch without rendezvous options keeps "
        "torchrun's static rendezvous on port 29500 (torchrun itself makes it --standalone)",
        "torchllm.run.launch:secure_rendezvous",
        "    if args.standalone or (args.rdzv_backend == \"static\" and not args.rdzv_endpoint\n"
        "                           and args.master_port is None and _max_nodes(args.nnodes) == 1):\n",
        "    if args.standalone:\n",
        ("tests/test_launch_security.py::test_the_rendezvous_id_is_random_unless_given_and_"
         "required_on_several_nodes",),
    ),
    Mutant.at(
        "error_files_of_first_failure_only", "the launcher names only the error files of the "
        "ranks torchrun reports (those that ended in one poll, often a rank that lost its "
        "peers), so the root cause's traceback file goes unnamed",
        "torchllm.run.launch:kept_error_files",
        "        for local in attempt.glob(\"*/error.json\"):\n",
        "        for local in [Path(failure.error_file)]:\n",
        ("tests/test_launcher.py::test_every_ranks_error_file_is_found_when_torchrun_names_only_"
         "the_first_failure",),
    ),
    Mutant.at(
        "launcher_skips_data_check", "run_train.sh's pre-flight check does not parse the data",
        "torchllm.run.launch:check_config", "    check_data(cfg.data, cfg.validation)  # every dataset spec, by the code "
        "the trainer parses them with\n", "",
        ("tests/test_data_kinds.py::test_the_launcher_checks_specs_with_the_trainers_parser",),
    ),
    Mutant.at(
        "torchrun_tee_left", "torchrun's tee folder is left under TMPDIR",
        "torchllm.run.launch:main", "    if args.log_dir is None:  # torchrun's tee files",
        "    if False:  # torchrun's tee files",
        ("tests/test_launch_path.py::"
         "test_two_ranks_are_torchrun_workers_and_a_killed_rank_1_is_named_with_its_signal",),
    ),
    Mutant.at(
        "no_bar_through_launcher", "run_train.sh on a terminal draws no progress bar",
        "torchllm.run.launch:main", "    if sys.stdout.isatty():  # rank 0 reports its step",
        "    if False:  # rank 0 reports its step",
        ("tests/test_console.py::test_run_train_sh_draws_the_bar_on_a_pseudo_terminal[2]",),
    ),
    Mutant.at(
        "stage_config_keeps_from_initial_load", "the run's config keeps "
        "'from_initial_load', not the tokenizer it resolved to", "torchllm.run.resolve:resolve_run",
        "    cfg = dataclasses.replace(cfg, data=stage_tokenizer(cfg.data, cfg.checkpoint,\n"
        "                                                        log=rank() == 0))\n",
        "    stage_tokenizer(cfg.data, cfg.checkpoint, log=rank() == 0)\n",
        ("tests/test_stage_tokenizer.py::test_run_train_sh_stages_use_the_tokenizer_their_initial_"
         "load_trained_with",),
    ),
    Mutant.at(
        "launch_stores_bind_all_interfaces",
        "a single-node launch leaves torchrun's TCPStores on torch's default (every interface)",
        "torchllm.run.launch:main",
        "        with loopback_stores() if local else contextlib.nullcontext():",
        "        with contextlib.nullcontext():",
        ("tests/test_launcher.py::test_a_single_node_launch_listens_on_loopback_only",),
    ),
    Mutant.at(
        "launch_fixed_rendezvous_id",
        "a c10d rendezvous without RDZV_ID gets a fixed, guessable id",
        "torchllm.run.launch:secure_rendezvous",
        "        args.rdzv_id = secrets.token_hex(16)",
        "        args.rdzv_id = \"torchllm\"",
        ("tests/test_launch_security.py::"
         "test_the_rendezvous_id_is_random_unless_given_and_required_on_several_nodes",),
    ),
    Mutant.at(
        "stage_auto_trains_a_new_tokenizer", "data.tokenizer = 'auto' with initial_load_path "
        "trains a new tokenizer on the stage's data", "torchllm.run.tokenizer:inherits",
        '    return tok == FROM_INITIAL_LOAD or (tok == "auto" and '
        "bool(ccfg.initial_load_path))\n",
        "    return tok == FROM_INITIAL_LOAD\n",
        ("tests/test_stage_tokenizer.py::"
         "test_a_stage_on_new_data_keeps_its_checkpoints_tokenizer",),
    ),
    Mutant.at(
        "optimizer_name_not_checked_at_launch", "the launcher's pre-flight check does not look "
        "optimizer.name up (an unknown one fails only in every worker)",
        "torchllm.run.launch:check_config",
        "    optim.get(cfg.optimizer.name)  # a registered optimizer",
        "    optim  # a registered optimizer",
        ("tests/test_optimizer_plugin.py::test_unknown_optimizer_is_refused_by_the_launchers_check",),
    ),
    Mutant.at(
        "worker_error_not_recorded", "a worker's exception never reaches torchrun's error file "
        "(TORCHELASTIC_ERROR_FILE): @record dropped from the worker's build-and-train",
        "torchllm.run.process:_build_and_train",
        "@record\ndef _build_and_train(",
        "def _build_and_train(",
        ("tests/test_launcher.py::test_an_error_on_rank_1_is_printed_once_on_rank_0s_console",),
    ),
    Mutant.at(
        "save_error_exit_code_not_4", "a checkpoint that cannot be saved (on_save_error = "
        "'stop') ends the process with exit code 1, as any crash, not 4",
        "torchllm.run.failures:exit_code",
        "    if isinstance(exc, CheckpointSaveError):\n        return 4\n",
        "    if isinstance(exc, CheckpointSaveError):\n        return 1\n",
        ("tests/test_store_errors.py::test_a_refusing_store_is_a_save_error_not_a_traceback",
         "tests/test_store_errors.py::test_a_stalled_store_with_stop_exits_4_naming_the_url"),
    ),
]
