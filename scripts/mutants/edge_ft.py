"""Mutants of 'replica groups of one run only': torchllm/ft/identity.py, the per-run lighthouse
(torchllm/ft/lighthouse.py, scripts/ft_local.sh) and the heal's shape check (scripts/mutation_check.py
runs them)."""

from __future__ import annotations

from mutants.base import Mutant

T = "tests/test_ft_one_run.py::"
RUNS = T + "test_two_runs_on_one_lighthouse_refuse_each_other_naming_the_runs"
FIELDS = T + "test_a_group_of_another_seed_tokenizer_and_width_is_refused_on_both_sides"
RECORDS = T + "test_identity_records_name_each_difference_and_travel_as_plain_bytes"
ACCEPTANCE = ("tests/test_fault_tolerance.py::"
              "test_a_killed_group_is_dropped_and_its_relaunch_heals_and_trains_in_step")

MUTANTS = [
    Mutant.at(
        "ft_identity_never_exchanged",
        "replica groups never exchange identity records: two runs (or two widths) on one "
        "lighthouse heal from and average with each other",
        "torchllm.ft.identity:checked_group",
        "            if world_size < 2:\n", "            if True:\n",
        (RUNS, FIELDS),
    ),
    Mutant.at(
        "ft_run_name_not_compared",
        "groups of two runs with the same config train as one (the run's name is not compared)",
        "torchllm.ft.identity:differences",
        '    if there["run"] != here["run"]:\n', "    if False:\n",
        (RECORDS, RUNS),
    ),
    Mutant.at(
        "ft_seed_not_compared",
        "a group started with another job.seed heals and trains beside its peers",
        "torchllm.ft.identity:group_record",
        'if k != "tokenizer_sha256"}', 'if k not in ("tokenizer_sha256", "seed")}',
        (RECORDS, FIELDS),
    ),
    Mutant.at(
        "ft_tokenizer_not_compared",
        "a group with another tokenizer heals and trains beside its peers (loss 6.33 beside 3.31)",
        "torchllm.ft.identity:differences",
        '    if there["tokenizer"] != here["tokenizer"]:\n', "    if False:\n",
        (RECORDS, FIELDS),
    ),
    Mutant.at(
        "ft_model_shape_not_compared",
        "groups of two model widths are not told apart (their all-reduce aborts in gloo)",
        "torchllm.ft.identity:group_record",
        '"model.name": cfg.model.name, **_flat("model", ctx.model_args),',
        '"model.name": cfg.model.name,',
        (RECORDS, FIELDS),
    ),
    Mutant.at(
        "ft_only_the_lower_group_refuses",
        "only the lower quorum rank refuses a stranger; the other goes on to heal or average "
        "with a peer that is gone",
        "torchllm.ft.identity:checked_group",
        "                why = None if peer == rank else ",
        "                why = None if peer == rank or rank > 0 else ",
        (RUNS, FIELDS),
    ),
    Mutant.at(
        "ft_refusal_not_raised_by_the_trainer",
        "the trainer ignores its quorum's refusal and trains on",
        "torchllm.ft.replicas:ReplicaGroups.begin_step",
        "            if self.pg.refusal:", "            if False:",
        (RUNS, FIELDS),
    ),
    Mutant.at(
        "ft_unreadable_record_accepted",
        "a peer whose identity record cannot be read (another version, garbage) is accepted",
        "torchllm.ft.identity:refusal",
        "    if there is None:\n", "    if there is None:\n        return None\n    if False:\n",
        (RECORDS,),
    ),
    Mutant.at(
        "ft_one_default_lighthouse_for_every_run",
        "every run's default lighthouse is http://localhost:29510: two runs on one machine share it",
        "torchllm.ft.lighthouse:default_address",
        "    return f\"http://localhost:{PORTS[int.from_bytes(digest, 'big') % len(PORTS)]}\"\n",
        '    return "http://localhost:29510"\n',
        (T + "test_each_run_has_a_lighthouse_of_its_own_by_default",),
    ),
    Mutant(
        "ft_local_reuses_another_runs_lighthouse",
        "scripts/ft_local.sh reuses whatever lighthouse answers, one started for another run too",
        "scripts/ft_local.sh",
        '&& [ "$owner" != "$run_label" ]; then', "&& false; then",
        (T + "test_ft_local_does_not_reuse_the_lighthouse_of_another_run",),
    ),
    Mutant.at(
        "ft_heal_compares_weight_names_only",
        "a heal from a peer of another width ends in a bare RuntimeError from copy_",
        "torchllm.ft.heal:_other_model",
        "        if mine != peer:\n", "        if False:\n",
        (T + "test_a_heal_into_another_width_is_refused_naming_the_weight",),
    ),
    Mutant.at(
        "ft_group_run_keeps_the_replica_suffix",
        "each group names its run by its own folder (<run>-replica<R>): the groups of one run "
        "refuse each other",
        "torchllm.ft.rundir:group_run",
        "    return name[:-len(suffix)] if ftcfg.enable and name.endswith(suffix) else name\n",
        "    return name\n",
        (T + "test_every_group_of_a_run_names_the_run_not_its_folder", ACCEPTANCE),
    ),
]
