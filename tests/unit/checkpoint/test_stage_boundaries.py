"""Stage boundaries: a base model trained without chat tokens goes on to a stage with them (the
embedding and output rows grow, new rows drawn around the mean of the saved rows), a vocabulary that
shrinks or changes base is an error naming both tokenizers, and relaunching a finished run
says so."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from torchllm.checkpoint import resolve_checkpoint
from torchllm.checkpoint import open_checkpoint
from torchllm.config import ConfigError
from torchllm.train import Trainer

from cli import run_module
from builders.checkpoint import torchrun_jobs
from conftest import tiny_args, tiny_config

pytestmark = pytest.mark.slow  # every test trains a run or two

VOCAB = ("tok_embeddings.weight", "output.weight")


@pytest.fixture
def log_text(caplog):
    caplog.set_level(logging.INFO, logger="torchllm")
    return lambda: caplog.text


def base_run(tmp_path):
    """Stage 1: 2 steps without chat tokens (512 ids, 512 rows); (its tokenizer, its weights)."""
    Trainer(tiny_config(tmp_path, "--checkpoint.enable", "--job.run_name=base",
                        "--training.steps=2")).train()
    (tok,) = (tmp_path / "base" / "data").glob("tokenizer_*.model")
    return tok, open_checkpoint(tmp_path / "base").tensors()


def next_stage(tmp_path, tok, name="mid", *extra):
    return Trainer(tiny_config(tmp_path, f"--job.run_name={name}", f"--data.tokenizer={tok}",
                               "--data.chat_tokens=true",
                               f"--checkpoint.initial_load_path={tmp_path / 'base'}", *extra))


def assert_grown(model_sd: dict, saved: dict, rows: int = 576) -> None:
    """The saved 512 rows kept; rows 512.. (6 chat tokens + padding to 576) drawn around their
    mean, each its own (transformers' draw: tests/unit/checkpoint/test_vocab_rows.py)."""
    for key in VOCAB:
        old, new = saved[key], model_sd[key]
        assert old.shape[0] == 512 and new.shape[0] == rows, key
        assert torch.equal(new[:512], old), key
        mean = old.double().mean(0).float()
        assert torch.allclose(new[512:], mean.expand(rows - 512, -1), atol=1e-4), key
        assert len({tuple(r.tolist()) for r in new[512:]}) == rows - 512, key
        assert not torch.allclose(new[512:], torch.zeros_like(new[512:])), key


def test_new_stage_with_chat_tokens_grows_the_vocab_rows_to_their_mean(tmp_path, log_text):
    tok, saved = base_run(tmp_path)
    mid = next_stage(tmp_path, tok)
    assert mid.model_args.vocab_size == 576  # 518 ids padded to model.vocab_pad_multiple = 64
    assert_grown(mid.model.state_dict(), saved)
    for key, value in saved.items():  # everything else as saved
        if key not in VOCAB:
            assert torch.equal(mid.model.state_dict()[key], value), key
    assert mid.step == 0 and mid.optimizer.state_dict()["state"] == {}  # weights only
    lines = [ln for ln in log_text().splitlines() if "vocabulary grown" in ln]
    assert len(lines) == 1 and "512 -> 518 ids (512 -> 576 rows" in lines[0], log_text()
    assert all(torch.isfinite(torch.tensor(mid.train())))

    # A checkpoint written before markers recorded the tokenizer grows the same way.
    marker = resolve_checkpoint(tmp_path / "base") / "COMPLETE"
    record = json.loads(marker.read_text())
    del record["tokenizer"]
    marker.write_text(json.dumps(record))
    assert_grown(next_stage(tmp_path, tok, "mid2").model.state_dict(), saved)


def test_shrinking_another_base_or_resuming_with_another_vocab_name_the_tokenizers(tmp_path):
    tok, _ = base_run(tmp_path)
    with pytest.raises(ConfigError) as e:
        next_stage(tmp_path, tok, "full", "--checkpoint.initial_load_model_only=false")
    # the checkpoint named, and the key (and value) that loads it
    assert str(tmp_path / "base") in str(e.value) and \
        "checkpoint.initial_load_model_only = true" in str(e.value)
    # Another base vocabulary (a new 600-piece tokenizer, + chat tokens: 640 rows) cannot grow.
    with pytest.raises(ConfigError) as e:
        Trainer(tiny_config(tmp_path, "--job.run_name=other", "--data.tokenizer_vocab_size=600",
                            "--data.tokenizer=train", "--data.chat_tokens=true",
                            f"--checkpoint.initial_load_path={tmp_path / 'base'}"))
    # both tokenizers named, and the key to set
    assert "data.tokenizer" in str(e.value) and str(tok) in str(e.value)
    assert "sp600" in str(e.value)
    # The chat stage's vocabulary cannot shrink back to the base one.
    next_stage(tmp_path, tok, "mid", "--checkpoint.enable", "--training.steps=1").train()
    with pytest.raises(ConfigError) as e:
        Trainer(tiny_config(tmp_path, "--job.run_name=back", f"--data.tokenizer={tok}",
                            f"--checkpoint.initial_load_path={tmp_path / 'mid'}"))
    assert "data.tokenizer" in str(e.value) and str(tok) in str(e.value)
    assert "+ 6 chat tokens (518 ids, 576 rows)" in str(e.value)
    assert "did model.name" not in str(e.value)
    # Resuming the base run itself with chat tokens stays an error (a resume never grows).
    with pytest.raises(ConfigError) as e:
        Trainer(tiny_config(tmp_path, "--checkpoint.enable", "--job.run_name=base",
                            f"--data.tokenizer={tok}", "--data.chat_tokens=true",
                            "--training.steps=4"))
    # the keys that changed, and the way to grow it (a new run from this checkpoint)
    assert "data.tokenizer" in str(e.value) and "data.chat_tokens" in str(e.value)
    assert "job.run_name" in str(e.value) and "checkpoint.initial_load_path" in str(e.value)


def test_vocab_grows_under_fsdp_on_two_ranks(tmp_path):
    """Stage 1 and the grown stage 2 both FSDP2-sharded over 2 gloo ranks (DTensor rows)."""
    fsdp = ("--parallelism.data_parallel_shard_degree=2", "--training.local_batch_size=2")
    base = tiny_args(tmp_path, *fsdp, "--checkpoint.enable", "--job.run_name=base",
                     "--training.steps=2")
    tok = tmp_path / "base" / "data" / "tokenizer_embedded_sp512.model"
    mid = tiny_args(tmp_path, *fsdp, "--job.run_name=mid", f"--data.tokenizer={tok}",
                    "--data.chat_tokens=true", f"--checkpoint.initial_load_path={tmp_path / 'base'}")
    torchrun_jobs(tmp_path / "jobs.json",
                  [{"train": base}, {"load": mid, "out": str(tmp_path / "mid.pt")}])
    got = torch.load(tmp_path / "mid.pt")
    assert_grown({k[len("model."):]: v for k, v in got.items() if k.startswith("model.")},
                 open_checkpoint(tmp_path / "base").tensors())


def test_relaunching_a_finished_run_says_so(tmp_path):
    args = tiny_args(tmp_path, "--checkpoint.enable", "--job.run_name=done", "--training.steps=2")
    outs = [run_module("torchllm.train", *args) for _ in range(2)]
    assert [p.returncode for p in outs] == [0, 0], outs[1].out[-3000:]

    def said(out: str) -> list[str]:  # the line: where the run is, and the keys that go on
        return [ln for ln in out.splitlines() if "step 2 of 2" in ln and "training.steps" in ln
                and "--job.overwrite" in ln and "--job.run_name" in ln]

    assert said(outs[0].out) == []
    assert len(said(outs[1].out)) == 1, outs[1].out[-3000:]
