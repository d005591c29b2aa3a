"""The one training state (torchllm/checkpoint/training_state.py): a piece added once is saved in
a checkpoint, restored by a resume and carried by a heal; the names a checkpoint saves are the
names a heal carries but for the documented rank-local parts (the RNG states; the data loader's
rank, which its peer_state_dict leaves out)."""

from __future__ import annotations

import pytest
import torch

from torchllm.checkpoint import TrainState, TrainingState, open_checkpoint
from torchllm.checkpoint.training_state import Piece
from torchllm.config import ConfigError, load_config
from torchllm.data import build_data, build_tokenizer
from torchllm.ft.heal import HealState
from torchllm.ft.heal_codec import decode, encode
from torchllm.train_module import TrainModule

from builders.data import data_args
from conftest import tiny_args, tiny_config
from messages import raises_naming

ARGS = ("--data.tokenizer=bytes", "--validation.enable=false", "--eval.sample_freq=0",
        "--training.steps=2")


class Ema:
    """A new piece of state (a buffer kept beside the weights), as a feature would add it."""

    def __init__(self):
        self.value, self.updates = torch.zeros(3), 0

    def state_dict(self) -> dict:
        return {"value": self.value.clone(), "updates": self.updates}

    def load_state_dict(self, sd: dict) -> None:
        self.value, self.updates = sd["value"].clone(), int(sd["updates"])


@pytest.fixture
def ema_piece(monkeypatch):
    """The train module's pieces plus "ema": the one place the new piece is added."""
    pieces = TrainModule.pieces

    def with_ema(self):
        if not hasattr(self, "ema"):
            self.ema = Ema()
        return [*pieces(self), Piece("ema", self.ema)]

    monkeypatch.setattr(TrainModule, "pieces", with_ema)


def test_a_piece_added_once_is_saved_restored_and_carried_by_a_heal(tmp_path, ema_piece):
    from torchllm.train import Trainer

    saving = [*ARGS, "--checkpoint.enable", "--checkpoint.interval=2"]
    live = Trainer(load_config(tiny_args(tmp_path / "a", *saving)))
    live.module.ema.value, live.module.ema.updates = torch.tensor([1.0, 2.0, 3.0]), 7
    live.train()
    # Saved: the checkpoint step holds it under its name.
    step = open_checkpoint(live.checkpointer.folder)
    saved = set(step.states)
    assert "ema" in saved
    # Restored: a relaunch reads it back.
    resumed = Trainer(load_config(tiny_args(tmp_path / "a", *saving)))
    fresh = Trainer(load_config(tiny_args(tmp_path / "b", *ARGS)))
    try:
        assert resumed.step == 2
        assert torch.equal(resumed.module.ema.value, torch.tensor([1.0, 2.0, 3.0]))
        assert resumed.module.ema.updates == 7
        # Carried by a heal: sent as data, applied into a fresh group's own piece.
        sent = decode(encode(HealState(resumed.state, lambda: None).state_dict()))
        HealState(fresh.state, lambda: None).load_state_dict(sent)
        assert torch.equal(fresh.module.ema.value, torch.tensor([1.0, 2.0, 3.0]))
        assert fresh.module.ema.updates == 7 and fresh.step == 2
        # One list: what the checkpoint saves is what the heal carries, but for the rank-local
        # parts: the RNG states (never sent) and the loader's rank (its part of the data).
        names = resumed.state.names()
        assert saved == {"dataloader_dp0" if n == "dataloader" else "rng_rank0" if n == "rng"
                         else n for n in names}
        assert set(sent) == set(names) - {"rng"}
        assert "dp_rank" not in sent["dataloader"] and "loader" in sent["dataloader"]
    finally:
        resumed.close()
        fresh.close()


def _heal_of(loader) -> HealState:
    state = TrainingState()
    state.add("dataloader", loader)
    state.add("train_state", TrainState())
    return HealState(state, lambda: None)


def test_a_heal_carries_the_data_position_not_the_senders_rank(tmp_path):
    cfg = tiny_config(tmp_path, "--data.tokenizer=bytes")
    tok = build_tokenizer(cfg.data, tmp_path / "data")
    sender, receiver, reference = (build_data(*data_args(cfg), tok, r, 2)[0] for r in (0, 1, 1))
    read, expected = iter(sender), iter(reference)
    for _ in range(3):
        next(read), next(expected)
    sent = decode(encode(_heal_of(sender).state_dict()))
    assert "dp_rank" not in sent["dataloader"]  # the sender's rank stays with the sender
    _heal_of(receiver).load_state_dict(sent)
    assert receiver.state_dict()["dp_rank"] == 1
    # The receiver continues its own part of the data at the sender's count.
    assert torch.equal(next(iter(receiver))["inputs"], next(expected)["inputs"])


def test_a_heal_of_other_pieces_is_refused_naming_them(tmp_path):
    cfg = tiny_config(tmp_path, "--data.tokenizer=bytes")
    loader = build_data(*data_args(cfg), build_tokenizer(cfg.data, tmp_path / "data"), 0, 1)[0]
    sent = _heal_of(loader).state_dict()
    receiver = _heal_of(loader)
    receiver.state.add("ema", Ema())
    receiver.pieces = receiver.state.sent()
    with raises_naming(ConfigError, "ema", key="fault_tolerance.enable"):
        receiver.load_state_dict(sent)
