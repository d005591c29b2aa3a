"""Mutants of streaming DiLoCo's heal (issue 65): a relaunch healed at an interval start counts
for nothing in the next sync of each fragment its source had not synced at that point, once
(torchllm/ft/semi_sync.py SemiSyncGroups.begin_step / end_step). scripts/mutation_check.py
runs them."""

from __future__ import annotations

from mutants.base import Mutant

UNIT = ("tests/test_ft_streaming.py::test_a_relaunch_healed_at_an_interval_start_counts_"
        "nothing_in_the_fragments_its_source_had_not_synced")
SS = "torchllm.ft.semi_sync:"

MUTANTS = [
    Mutant.at(
        "ft_fragments_heal_copy_counted",
        "a group healed at an interval start counts its copy of its source's change in the next "
        "sync of the fragments its source had not synced: that change counts twice",
        SS + "SemiSyncGroups.begin_step",
        "self.uncounted = set(range(self.num_fragments)) - set(synced)",
        "self.uncounted = set()",
        (UNIT,),
    ),
    Mutant.at(
        "ft_fragments_heal_uncounted_kept",
        "a healed group's unsynced fragments stay uncounted after their sync: its own change "
        "never counts in them again",
        SS + "SemiSyncGroups.end_step",
        "        self.uncounted -= set(fragments)\n",
        "",
        (UNIT,),
    ),
    Mutant.at(
        "ft_fragments_heal_step_before_heal",
        "begin_step judges the unsynced fragments by the relaunch's own step from before the "
        "heal (its launch's): a relaunch counts its copy",
        SS + "SemiSyncGroups.begin_step",
        "            step = self.heal.train_state.step  #",
        "            step = step  #",
        (UNIT,),
    ),
]
