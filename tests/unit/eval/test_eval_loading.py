"""Checkpoint resolution and loading for inference, on checkpoints written here with dcp.save
(through the checkpointer's writer: its index is JSON)."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchllm import models
from torchllm.config import to_toml
from torchllm.data import build_tokenizer
from torchllm.checkpoint import resolve_checkpoint
from torchllm.checkpoint.index import dcp_writer
from torchllm.checkpoint.integrity import folder_checksums
from torchllm.checkpoint.layout import mark_complete
from torchllm.eval.loading import load_for_inference

from conftest import tiny_config
from messages import raises_naming
from builders.eval import write_run  # noqa: F401


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("eval_loading"))


def test_resolve_checkpoint_forms(run, tmp_path):
    run_dir, _ = run
    ckpt = run_dir / "checkpoint"
    assert resolve_checkpoint(run_dir) == ckpt / "step-2"  # latest complete; step-3 is partial
    assert resolve_checkpoint(ckpt) == ckpt / "step-2"
    assert resolve_checkpoint(ckpt / "step-1") == ckpt / "step-1"
    with pytest.raises(FileNotFoundError, match="incomplete"):
        resolve_checkpoint(ckpt / "step-3")
    (tmp_path / "empty").mkdir()
    with raises_naming(FileNotFoundError, tmp_path / "empty", "step-<N>"):  # where, what it sought
        resolve_checkpoint(tmp_path / "empty")
    with raises_naming(FileNotFoundError, tmp_path / "missing", "folder"):
        resolve_checkpoint(tmp_path / "missing")


def test_load_for_inference_restores_the_saved_weights(run):
    run_dir, states = run
    for path, step in ((run_dir, 2), (run_dir / "checkpoint" / "step-1", 1)):
        model, cfg, tokenizer = load_for_inference(path, "cpu")
        assert not model.training
        assert cfg.model.max_seq_len == 128 and tokenizer.vocab_size == 512
        loaded = model.state_dict()
        assert loaded.keys() == states[step].keys()
        for name, value in states[step].items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
        # RoPE is a buffer that is not saved; it must be rebuilt, not left uninitialized.
        assert torch.isfinite(model.rope_cache).all()
