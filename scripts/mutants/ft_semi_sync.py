"""Mutants of semi-synchronous replica groups (DiLoCo, LocalSGD): torchllm/ft/semi_sync.py,
its config checks in torchllm/config/sections_ft.py and its hook in torchllm/train.py
(scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

T = "tests/test_ft_semi_sync.py::"
DILOCO = T + "test_two_groups_equal_the_algorithm_in_plain_pytorch[diloco]"
LOCAL_SGD = T + "test_two_groups_equal_the_algorithm_in_plain_pytorch[local_sgd]"
INTERVAL = T + "test_a_checkpoint_interval_between_syncs_is_refused_naming_both_keys"
NO_GROUPS = T + "test_semi_sync_without_replica_groups_is_refused"
HEAL = T + "test_a_heal_copies_the_last_sync_and_the_outer_momentum_as_data"
SAVES = T + "test_saves_between_syncs_are_skipped_unless_kept_for_inspection"
FT_LOCAL = T + "test_two_diloco_groups_through_ft_local_end_with_equal_weights"
PREFLIGHT = T + "test_ft_local_refuses_an_interval_between_syncs_before_starting_a_group"
SS = "torchllm.ft.semi_sync:"

MUTANTS = [
    Mutant.at(
        "ft_semi_sync_interval_between_syncs",
        "a checkpoint.interval that is not a multiple of sync_steps is accepted: checkpoints "
        "between syncs hold each group's own weights",
        "torchllm.config.sections_ft:semi_sync_errors",
        "    if ckpt.enable and ckpt.interval % ft.sync_steps:",
        "    if False:",
        (INTERVAL,),
    ),
    Mutant.at(
        "ft_semi_sync_without_groups_ignored",
        "semi_sync_method set without fault_tolerance.enable is silently ignored",
        "torchllm.config.sections_ft:fault_tolerance_errors",
        '        if ft.semi_sync_method != "none":',
        "        if False:",
        (NO_GROUPS,),
    ),
    Mutant.at(
        "ft_semi_sync_outer_plain_momentum",
        "DiLoCo's outer optimizer built without Nesterov (plain heavy-ball momentum)",
        SS + "OuterStep.__init__",
        "nesterov=nesterov)",
        "nesterov=False)",
        (DILOCO,),
    ),
    Mutant.at(
        "ft_semi_sync_pseudo_gradient_sign",
        "the pseudo-gradient taken as now - last sync: the outer step moves the weights back",
        SS + "OuterStep.sync",
        "pseudo = [a - _local(p) for",
        "pseudo = [_local(p) - a for",
        (DILOCO,),
    ),
    Mutant.at(
        "ft_semi_sync_anchor_kept",
        "the parameters at the last sync are not renewed after a sync: every later "
        "pseudo-gradient is measured from the first weights",
        SS + "OuterStep.sync",
        "        self.reset_anchor(frags)\n        return True",
        "        return True",
        (DILOCO,),
    ),
    Mutant.at(
        "ft_semi_sync_local_sgd_not_applied",
        "LocalSGD averages the groups' parameters but never copies the mean back",
        SS + "OuterStep.sync",
        "                _local(p).copy_(avg)\n",
        "                pass\n",
        (LOCAL_SGD,),
    ),
    Mutant.at(
        "ft_semi_sync_last_step_not_synced",
        "a run whose steps are not a multiple of sync_steps ends without a last sync: the "
        "groups' final weights differ",
        SS + "SemiSyncGroups.due",
        "step == self.last_step or ",
        "",
        (DILOCO, LOCAL_SGD),
    ),
    Mutant.at(
        "ft_semi_sync_quorum_every_step",
        "a quorum (a lighthouse round trip, and a wait for every group) at every step",
        SS + "SemiSyncGroups.begin_step",
        "if not self.quorum_taken or (step - 1) % self.sync_steps == 0:",
        "if True:",
        (DILOCO, LOCAL_SGD),
    ),
    Mutant.at(
        "ft_semi_sync_momentum_not_healed",
        "a heal copies the last sync's parameters but not the outer optimizer's momentum",
        SS + "OuterStep.load_state_dict",
        "            for p, theirs in zip(self.params, momentum or []):",
        "            for p, theirs in zip(self.params, []):",
        (HEAL,),
    ),
    Mutant.at(
        "ft_semi_sync_saves_between_syncs",
        "checkpoints are saved between syncs (each group's own weights, which a resume or a "
        "heal would take as the run's)",
        SS + "SyncPointCheckpointer.save",
        "if self.replicas.is_sync_point(step) or",
        "if True or",
        (SAVES,),
    ),
    Mutant.at(
        "ft_semi_sync_no_sync_hook",
        "the trainer never calls the sync after its update: the groups never meet",
        "torchllm.train:Trainer.train_step",
        "        self.replicas.end_step()  # FT semi-synchronous",
        "        pass  # FT semi-synchronous",
        (FT_LOCAL,),
    ),
    Mutant.at(
        "ft_semi_sync_outer_state_as_json",
        "the outer optimizer's momentum saved as a JSON text (no DCP tensors: unsharded, and "
        "model-sized lists of numbers)",
        SS + "SemiSyncGroups.register_state",
        "self.state.outer, OPTIMIZER, model=model,",
        "self.state.outer, model=model,",
        (FT_LOCAL,),
    ),
    Mutant(
        "ft_semi_sync_preflight_not_as_groups",
        "ft_local.sh checks the config without fault_tolerance.enable / group_size: the groups' "
        "own checks (semi-sync, min_replica_size) refuse it only after the lighthouse started, "
        "or refuse what the groups accept",
        "scripts/ft_local.sh",
        'run=$(python -m torchllm.ft --job.config_file "$config_file" '
        '--fault_tolerance.enable=true \\\n'
        '      --fault_tolerance.group_size="$groups" "$@") \\\n',
        'run=$(python -m torchllm.ft --job.config_file "$config_file" "$@") \\\n',
        (PREFLIGHT,),
    ),
]
