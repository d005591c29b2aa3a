"""Mutants of a relaunch that heals into a retried semi-synchronous sync (issue 65): it joins the
sync counting for nothing (torchllm/ft/semi_sync.py, the weight in torchllm/ft/reduce.py) and does
not train the step again (its hook in torchllm/train.py); and of streaming DiLoCo's fragments
(torchllm/ft/fragments.py). scripts/mutation_check.py runs them."""

from __future__ import annotations

from mutants.base import Mutant

UNIT = "tests/test_ft_semi_sync.py::test_a_group_healed_into_a_retried_sync_joins_it_counting_for_nothing"
ONLY_HEALED = ("tests/test_ft_semi_sync.py::"
               "test_a_retried_sync_of_groups_that_all_healed_into_it_averages_their_copies")
HEAL = ("tests/test_ft_semi_sync_heal.py::"
        "test_a_relaunch_that_heals_into_a_retried_sync_leaves_the_live_groups_mean")
SS = "torchllm.ft.semi_sync:"
FRAGMENTS = "tests/test_ft_streaming.py::test_fragments_are_contiguous_blocks_synced_in_turn"
FRAGMENTS_FT_LOCAL = ("tests/test_ft_streaming.py::"
                      "test_two_groups_with_two_fragments_through_ft_local_end_equal_sending_half")

MUTANTS = [
    Mutant.at(
        "ft_sync2_healed_group_counted",
        "a group that healed into a retried sync is counted in its mean (its zeros weigh 1): "
        "the live groups' change is divided by one group too many",
        SS + "SemiSyncGroups._mean",
        "mean_over_groups(self.manager, tensors, weight=0.0)",
        "mean_over_groups(self.manager, tensors, weight=1.0)",
        (UNIT, HEAL),
    ),
    Mutant.at(
        "ft_sync2_healed_copy_sent",
        "a group that healed into a retried sync sends its copy of its source's change instead "
        "of zeros: the source's change counts twice",
        SS + "SemiSyncGroups._mean",
        "        for t in tensors:\n            t.zero_()\n",
        "        for t in tensors:\n            pass\n",
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
        "ft_sync2_no_counted_group_nan",
        "a sync whose quorum holds only groups that healed into it (their sources died during "
        "it) divides by zero groups: NaN weights",
        "torchllm.ft.reduce:_over_groups",
        "        elif weight == 0.0 and flat[-1].item() == 0:",
        "        elif False:",
        (ONLY_HEALED,),
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
    Mutant.at(
        "ft_sync2_fragments_synced_together",
        "every fragment syncs at the interval's end (no streaming: one burst of the whole model)",
        "torchllm.ft.fragments:due",
        "at == sync_steps // n * (f + 1) % sync_steps",
        "at == 0",
        (FRAGMENTS, FRAGMENTS_FT_LOCAL),
    ),
    Mutant.at(
        "ft_sync2_fragment_by_block_index_only",
        "the embeddings go with the last fragment (the blocks' order only): the first fragment's "
        "sync misses them",
        "torchllm.ft.fragments:fragment_of",
        "            out.append(n - 1 if seen else 0)",
        "            out.append(n - 1)",
        (FRAGMENTS, FRAGMENTS_FT_LOCAL),
    ),
]
