"""A dedicated validation.dataset is read whole (up to validation.max_tokens), every batch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from torchllm.config import ConfigError, load_config
from torchllm.data.prepare import prepare
from torchllm.eval.in_training import validation_loader
from torchllm.train import Trainer

from conftest import tiny_args
from builders.data import validation_args

SEQ = 32


def write_texts(path, n, seed):
    rng = np.random.default_rng(seed)
    words = "a validation text about rivers stones birds and old walls".split()
    texts = [f"val{i} " + " ".join(rng.choice(words, int(rng.integers(10, 80)))) for i in range(n)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


def all_windows(loader) -> torch.Tensor:
    """Every window of the loader, as inputs + the last target (the window's tokens); the rows
    that fill a rank's last batch (no target scored) left out."""
    rows = [torch.cat([b["inputs"], b["targets"][:, -1:]], dim=1)[(b["targets"] != -100).any(1)]
            for b in loader]
    return torch.cat(rows)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("valds")
    texts = write_texts(tmp / "val.jsonl", 40, seed=1)
    # A budget above the file's size (the default, 0 = auto, is a share of the run's compute:
    # test_validation_set.py)
    t = Trainer(load_config(tiny_args(tmp, "--validation.enable",
                                      "--validation.max_tokens=10000000",
                                      f"--validation.dataset=local:{tmp / 'val.jsonl'}")))
    return t, texts, tmp


def test_the_whole_file_is_validated_every_time(trainer):
    t, texts, tmp = trainer
    # Oracle: the file's documents tokenized and packed by hand, cut into windows of SEQ + 1.
    packed = [i for text in texts for i in t.tokenizer.encode(text, bos=True, eos=True)]
    n_windows = len(packed) // (SEQ + 1)
    expected = torch.tensor(packed[: n_windows * (SEQ + 1)]).view(n_windows, SEQ + 1)
    batches, steps = validation_loader(*validation_args(t.cfg), t.tokenizer, t.val_loader, 0, 1)
    assert torch.equal(all_windows(batches), expected)
    assert steps == -(-n_windows // t.cfg.training.local_batch_size) > t.cfg.validation.steps
    m = t.evaluator.validation(1)
    # every window, not validation.steps batches; the tags name the set
    assert m["val/val.jsonl/tokens"] == n_windows * SEQ and "val/loss" not in m

    # The budget: max_tokens // (SEQ + 1) windows spread evenly over the whole file, the first
    # at its start, one every n_windows / 6 windows (not the first 200 tokens).
    cfg = load_config(tiny_args(tmp, "--validation.enable", "--validation.max_tokens=200",
                                f"--validation.dataset=local:{tmp / 'val.jsonl'}"))
    batches, _ = validation_loader(*validation_args(cfg), t.tokenizer, t.val_loader, 0, 1)
    picked = [i * n_windows // 6 for i in range(6)]
    assert 200 // (SEQ + 1) == 6 and picked[-1] > n_windows * 3 // 4
    assert torch.equal(all_windows(batches), expected[picked])
    assert f"spread evenly over all its {n_windows} windows" in batches.describe()
    # Two ranks share out the same spread windows.
    halves = [validation_loader(*validation_args(cfg), t.tokenizer, t.val_loader, r, 2)[0] for r in (0, 1)]
    assert torch.equal(torch.cat([all_windows(b) for b in halves]), expected[picked])
    # Two data-parallel ranks split the same windows between them: all of them, in the same
    # number of batches.
    halves = [validation_loader(*validation_args(t.cfg), t.tokenizer, t.val_loader, r, 2) for r in (0, 1)]
    assert torch.equal(torch.cat([all_windows(b) for b, _ in halves]), expected)
    assert halves[0][1] == halves[1][1] == len(list(halves[1][0]))


def test_a_shards_folder_is_read_whole(trainer, tmp_path):
    t, texts, tmp = trainer
    tok_path = str(next((tmp / "default" / "data").glob("*.model")))
    prepare(load_config([f"--data.dataset=local:{tmp / 'val.jsonl'}"]).data, tok_path,
            tmp_path / "s", 300, None, 1, progress=False, val_fraction=0.1)
    cfg = load_config(tiny_args(tmp, "--validation.enable", "--validation.max_tokens=10000000",
                                f"--validation.dataset=shards:{tmp_path / 's'}"))
    packed = [i for text in texts for i in t.tokenizer.encode(text, bos=True, eos=True)]
    batches, _ = validation_loader(*validation_args(cfg), t.tokenizer, t.val_loader, 0, 1)
    windows = all_windows(batches)
    # val split first, then train: together every token of the file (whole windows of it).
    from torchllm.data.sources.shards import open_split

    val, train = open_split(tmp_path / "s", "val"), open_split(tmp_path / "s", "train")
    tokens = np.concatenate([val.read(0, len(val)), train.read(0, len(train))])
    assert sorted(tokens.tolist()) == sorted(packed)
    n = len(tokens) // (SEQ + 1)
    assert torch.equal(windows, torch.from_numpy(tokens[: n * (SEQ + 1)].astype(np.int64))
                       .view(n, SEQ + 1))


def test_bad_validation_settings_are_named(tmp_path):
    with pytest.raises(ConfigError, match="validation.max_tokens = -1"):
        load_config(tiny_args(tmp_path, "--validation.max_tokens=-1"))
    (tmp_path / "empty.jsonl").write_text("")
    cfg = load_config(tiny_args(tmp_path, "--validation.enable",
                                f"--validation.dataset=local:{tmp_path / 'empty.jsonl'}"))
    with pytest.raises(ConfigError, match="validation.dataset = 'local:.*empty"):
        validation_loader(*validation_args(cfg), None, None, 0, 1)
