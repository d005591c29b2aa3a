"""Mutants of config loading, shipped configs (scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

MUTANTS = [
    Mutant.at(
        "float_range_allows_inf", "a config float Range lets inf through (lr=inf trains to NaN)",
        "torchllm.config.fields:Range.__contains__", "        if not math.isfinite(x):\n            return False\n",
        "",
        ("tests/test_config.py::test_every_float_key_refuses_nan_and_inf",),
    ),
    Mutant.at(
        "run_name_dotdot", "job.run_name = '..' is accepted (overwrite deletes the dump folder)",
        "torchllm.config.paths:bad_name", 'return name in ("", ".", "..") or',
        'return name in ("", ".") or',
        ("tests/test_run_safety.py::test_run_name_is_one_folder_name_and_other_runs_survive",),
    ),
    Mutant.at(
        "subfolder_dotdot", "checkpoint.folder / metrics.tb_folder may climb out with '..'",
        "torchllm.config.paths:bad_subfolder", 'or ".." in posix.parts ', "",
        ("tests/test_run_safety.py::test_folder_keys_stay_below_their_folder",),
    ),
    Mutant(
        "speedrun_validates_a_sample", "the speedrun config validates on 10 batches, not on all of "
        "nanoGPT's held-out 10%",
        "train_configs/speedrun_shakespeare_cpu.toml",
        "steps = 100000   # every held-out window\n", "\n",
        ("tests/test_train_configs.py::test_speedrun_config_runs_through_run_train_sh_on_its_"
         "default_text",),
    ),
    Mutant.at(
        "from_initial_load_without_path", "from_initial_load with an empty initial_load_path "
        "is not named as such", "torchllm.config.job_config:JobConfig.validate",
        '        if self.data.tokenizer == "from_initial_load" and not '
        'self.checkpoint.initial_load_path:\n',
        "        if False:\n",
        ("tests/test_stage_tokenizer.py::test_without_initial_load_path_it_is_one_line",),
    ),
    Mutant.at(
        "chat_packing_causal_by_default",
        "chat data keeps plain causal attention over the packed window (conversations see the "
        "ones packed before them)",
        "torchllm.config.job_config:document_masking",
        '    return (("block_causal" if chat else "causal") if mask == "auto" else mask,',
        '    return ("causal" if mask == "auto" else mask,',
        ("tests/test_chat_isolation.py::test_packed_conversations_train_as_if_each_were_alone",),
    ),
    Mutant.at(
        "chat_packing_positions_run_on",
        "chat data's positions run on over the packed window (restart off by default)",
        "torchllm.config.job_config:document_masking",
        "            chat if restart is None else restart)",
        "            False if restart is None else restart)",
        ("tests/test_chat_isolation.py::test_packed_conversations_train_as_if_each_were_alone",),
    ),
    Mutant.at(
        "chat_prefix_not_a_packing",
        "chat:PATH is not told apart from a source spec (no packing prefix is recognised)",
        "torchllm.config.job_config:data_packing",
        "    return (prefix, location) if sep and prefix in PACKINGS else (TEXT, None)\n",
        "    return (TEXT, None)\n",
        ("tests/test_data_kinds.py::test_the_registry_maps_each_prefix_to_its_source_module",),
    ),
    Mutant.at(
        "custom_import_ignored", "job.custom_import is accepted but never imported",
        "torchllm.config.loader:load_config",
        "        import_custom(cfg.job.custom_import)\n",
        "        import_custom(None)\n",
        ("tests/test_model_family_plugin.py::test_custom_import_that_fails_names_the_key",),
    ),
    Mutant.at(
        "job_seed_unchecked", "job.seed = 99999999999999999999 passes the check, then crashes",
        "torchllm.config.job_config:JobConfig.rules",
        "            (\"job.seed\", 0 <= self.job.seed < 2**32,",
        "            (\"job.seed\", True,",
        ("tests/test_unclear_errors.py::test_a_seed_numpy_cannot_take_is_a_config_error_at_check_time[99999999999999999999]",),
    ),
]
