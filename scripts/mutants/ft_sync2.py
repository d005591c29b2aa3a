"""Mutants of a relaunch that heals into a retried semi-synchronous sync (issue 65): it joins the
sync counting for nothing (torchllm/ft/semi_sync.py, the weight in torchllm/ft/reduce.py) and does
not train the step again (its hook in torchllm/train.py). scripts/mutation_check.py runs them."""

from __future__ import annotations

from mutants.base import Mutant

UNIT = "tests/test_ft_semi_sync.py::test_a_group_healed_into_a_retried_sync_joins_it_counting_for_nothing"
HEAL = ("tests/test_ft_semi_sync_heal.py::"
        "test_a_relaunch_that_heals_into_a_retried_sync_leaves_the_live_groups_mean")
SS = "torchllm.ft.semi_sync:"

MUTANTS = [
    Mutant.at(
        "ft_sync2_healed_group_counted",
        "a group that healed into a retried sync is counted in its mean (its zeros weigh 1): "
        "the live groups' change is divided by one group too many",
        SS + "SemiSyncGroups._mean",
        "weight=0.0 if self.joining else 1.0",
        "weight=1.0",
        (UNIT, HEAL),
    ),
    Mutant.at(
        "ft_sync2_healed_copy_sent",
        "a group that healed into a retried sync sends its copy of its source's change instead "
        "of zeros: the source's change counts twice",
        SS + "SemiSyncGroups._mean",
        "            for t in tensors:\n                t.zero_()\n",
        "            pass\n",
        (UNIT, HEAL),
    ),
    Mutant.at(
        "ft_sync2_healed_group_trains_the_step",
        "a group that healed into a retried sync trains the sync's step once more before it "
        "joins (the bug of issue 65's Limits)",
        SS + "SemiSyncGroups.begin_step",
        "                return False\n",
        "                return True\n",
        (UNIT, HEAL),
    ),
    Mutant.at(
        "ft_sync2_pending_not_sent",
        "the survivor waiting to run its sync again does not say so in the heal it sends: the "
        "relaunch trains the step again",
        SS + "SemiSyncGroups.end_step",
        "            self.pending = step  #",
        "            self.pending = 0  #",
        (HEAL,),
    ),
    Mutant.at(
        "ft_sync2_trainer_trains_a_joined_step",
        "the trainer ignores begin_step's answer and trains a step whose update came with the heal",
        "torchllm.train:Trainer.train_step",
        "        if not self.replicas.begin_step():",
        "        if not (self.replicas.begin_step() or True):",
        (HEAL,),
    ),
]
