"""Mutants of the one training state (issue 65 #5, issue 64): the list a checkpoint saves and a
heal copies, and the loader's part a peer may take (scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

STATE = "tests/test_training_state.py::"
ADDED_ONCE = STATE + "test_a_piece_added_once_is_saved_restored_and_carried_by_a_heal"

MUTANTS = [
    Mutant.at(
        "heal_drops_a_piece_the_checkpoint_has",
        "the heal sends the pieces it knows by name (as HealState once listed them): a feature's "
        "new piece is saved in checkpoints but never reaches a relaunched group",
        "torchllm.ft.heal:HealState.__init__",
        "self.state, self.pieces = state, state.sent()",
        "self.state, self.pieces = state, {k: p for k, p in state.sent().items() if k in ("
        "'model', 'optimizer', 'lr_scheduler', 'dataloader', 'train_state', 'loss_guard')}",
        (ADDED_ONCE,),
    ),
    Mutant.at(
        "heal_leaks_the_senders_data_rank",
        "the loader's state a peer takes keeps the sender's data-parallel rank (its own part of "
        "the data), which the receiver then reads as its own",
        "torchllm.data.loader:TrainLoader.peer_state_dict",
        '        del state["dp_rank"]  # the sender\'s\n',
        "",
        (ADDED_ONCE, STATE + "test_a_heal_carries_the_data_position_not_the_senders_rank"),
    ),
    Mutant.at(
        "heal_pieces_not_compared",
        "a heal from a peer with other pieces of state is applied piece by piece until a "
        "KeyError (half of the state already overwritten)",
        "torchllm.ft.heal:HealState.load_state_dict",
        "        if set(sd) != set(self.pieces):\n",
        "        if False:\n",
        (STATE + "test_a_heal_of_other_pieces_is_refused_naming_them",),
    ),
]
