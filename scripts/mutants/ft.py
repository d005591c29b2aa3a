"""Mutants of fault tolerance: torchllm/ft and scripts/ft_local.sh (scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

ACCEPTANCE = ("tests/test_fault_tolerance.py::"
              "test_a_killed_group_is_dropped_and_its_relaunch_heals_and_trains_in_step")

MUTANTS = [
    Mutant.at(
        "ft_heal_skips_optimizer",
        "a relaunched replica group heals weights, schedule and data but keeps its own (fresh) "
        "optimizer state: its updates differ from the live group's",
        "torchllm.ft.heal:_apply",
        "            opt.load_state_dict(state)\n",
        "            pass  # the optimizer state is not taken from the peer\n",
        ("tests/test_fault_tolerance.py::"
         "test_heal_makes_a_fresh_trainer_continue_exactly_like_the_live_one", ACCEPTANCE),
    ),
    Mutant(
        "ft_dead_group_never_dropped",
        "the lighthouse keeps a group that stopped heartbeating in the quorum (10-minute "
        "heartbeat and join timeouts): the survivors wait for the dead group instead of training",
        "scripts/ft_local.sh",
        '--heartbeat_timeout_ms "${FT_HEARTBEAT_TIMEOUT_MS:-5000}" \\\n'
        '        --join_timeout_ms "${FT_JOIN_TIMEOUT_MS:-60000}"',
        '--heartbeat_timeout_ms 600000 \\\n        --join_timeout_ms 600000',
        (ACCEPTANCE,),
    ),
    Mutant.at(
        "ft_below_min_saves_a_step_never_run",
        "a run stopping for too few replica groups saves the step whose quorum failed (never "
        "trained) as done",
        "torchllm.train:Trainer.train",
        "            self.train_state.step -= 1  # the step that quorum was for never ran\n", "",
        ("tests/test_fault_tolerance.py::"
         "test_too_few_groups_saves_the_last_completed_step_and_ends_cleanly",),
    ),
    Mutant.at(
        "ft_below_min_ignored", "groups keep training below fault_tolerance.min_replica_size",
        "torchllm.ft.replicas:ReplicaGroups.begin_step", "            if live >= self.min_replica_size:\n",
        "            if live >= 1:\n",
        ("tests/test_fault_tolerance.py::"
         "test_below_min_replica_size_stops_after_a_commit_and_waits_at_launch",),
    ),
    Mutant.at(
        "ft_every_group_saves", "every replica group saves every checkpoint, not the lowest live",
        "torchllm.ft.replicas:ReplicaGroups.saves",
        "        return last or self.manager.participating_rank() == 0\n",
        "        return True\n",
        ("tests/test_fault_tolerance.py::"
         "test_only_the_lowest_live_group_saves_but_every_group_saves_the_last_step",),
    ),
    Mutant.at(
        "ft_groups_read_the_same_data", "every replica group reads the same part of the data",
        "torchllm.ft.replicas:ReplicaGroups.data_shard",
        "        return self.replica_id * dp_degree + dp_rank, self.group_size * dp_degree\n",
        "        return dp_rank, dp_degree\n",
        ("tests/test_fault_tolerance.py::test_each_group_reads_its_own_part_of_the_data",),
    ),
    Mutant.at(
        "ft_relaunch_refused_over_its_outputs",
        "a relaunched replica group (no checkpoint of its own: the lowest live group saves) is "
        "refused as a fresh start over a previous run's outputs",
        "torchllm.run.rundir:check_fresh_start",
        "    if replica and not overwrite:\n",
        "    if False:\n",
        (ACCEPTANCE,),
    ),
]
