"""docs/howto_data_source.md's promise: a new data source is one file and one registry line. A toy
source defined in a test folder (tests/data_sources/toy_counting.py) registers itself, is parsed
by the launcher's check, packs its documents into exactly the windows an independent packing of
its text gives, and trains through the Trainer alone and in a mixture."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest
import torch

from torchllm.config import ConfigError
from torchllm.data import build_data, load_tokenizer
from torchllm.data.sources.registry import PREFIXES
from torchllm.run.launch import check_config

from conftest import REPO, tiny_args, tiny_config
from messages import raises_naming
from builders.data import data_args

SEQ = 32


@pytest.fixture
def counting():
    """The toy module imported the way sources/__init__.py imports a source (its one line),
    unregistered afterwards so the registry's own tests see only the shipped sources."""
    sys.path.insert(0, str(REPO / "tests" / "data_sources"))
    try:
        yield importlib.import_module("toy_counting")
    finally:
        PREFIXES.pop("counting", None)
        sys.modules.pop("toy_counting", None)
        sys.path.remove(str(REPO / "tests" / "data_sources"))


def test_a_toy_source_packs_its_documents_into_the_windows(tmp_path, counting):
    args = tiny_args(tmp_path, "--data.dataset=counting:60", "--data.tokenizer=bytes",
                     "--data.val_fraction=0.1", "--validation.enable")
    check_config(args, 1)  # the launcher's pre-flight parses it too
    tok = load_tokenizer("bytes")
    train, val = build_data(*data_args(tiny_config(tmp_path, *args[1:])), tok, 0, 1)
    # Oracle: the documents encoded BOS..EOS by hand (bytes: id = UTF-8 byte), concatenated,
    # the last 10% held out, cut into windows of SEQ + 1.
    stream = [t for d in counting.counting_documents(60)
              for t in [256, *d.encode(), 257]]
    cut = len(stream) - int(len(stream) * 0.1)
    windows = {tuple(stream[k * (SEQ + 1):(k + 1) * (SEQ + 1)]) for k in range(cut // (SEQ + 1))}
    batch = next(iter(train))
    rows = torch.cat([batch["inputs"], batch["targets"][:, -1:]], 1).tolist()
    assert all(tuple(r) in windows for r in rows) and len(set(map(tuple, rows))) == 4
    held = [w["inputs"].tolist() for w in val.dataset]
    assert held[0] == stream[cut:cut + SEQ]
    with pytest.raises(ConfigError, match="counting:x.*whole number"):
        check_config(tiny_args(tmp_path, "--data.dataset=counting:x"), 1)


def test_an_unregistered_source_is_not_known(tmp_path):
    with raises_naming(ConfigError, "'counting:6'", "'embedded'", key="data.dataset"):
        check_config(tiny_args(tmp_path, "--data.dataset=counting:6"), 1)


@pytest.mark.slow
def test_the_trainer_trains_on_a_toy_source_alone_and_in_a_mixture(tmp_path, counting):
    from torchllm.train import Trainer

    losses = Trainer(tiny_config(tmp_path, "--data.dataset=counting:200",
                                 "--data.tokenizer=bytes", "--training.steps=3")).train()
    assert len(losses) == 3 and all(np.isfinite(losses))
    # The same source in a mixture, beside a shipped one: a source of sources.
    mixed = Trainer(tiny_config(tmp_path, "--job.run_name=mixed", "--data.tokenizer=bytes",
                                "--data.sources=counting:200=0.5,tinyshakespeare=0.5",
                                "--training.steps=2")).train()
    assert len(mixed) == 2 and all(np.isfinite(mixed))
