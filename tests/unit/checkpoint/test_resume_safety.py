"""Resuming safely (issue 28): an unreadable COMPLETE marker, a failed resume and the run's
config.toml, retention that cannot delete, and the precision a resumed run continues in."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from torchllm import precision
from torchllm.checkpoint import complete_steps
from torchllm.checkpoint import open_checkpoint
from torchllm.checkpoint.layout import MARKER, mark_complete
from torchllm.checkpoint.step import read_marker
from torchllm.train import Trainer

from cli import run_module
from builders.checkpoint import copy_run, trained_once
from conftest import tiny_args, tiny_config

CKPT = ["--checkpoint.enable", "--job.run_name=run", "--checkpoint.interval=2",
        "--checkpoint.keep_latest_k=0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 4 (copied by each test)."""
    return trained_once(tmp_path_factory, *CKPT)


@pytest.fixture
def run(trained, tmp_path):
    return copy_run(trained, tmp_path)


@pytest.fixture
def fresh(trained, tmp_path):
    """A folder for a new run `run` that finds its tokenizer cached (training one takes long)."""
    shutil.copytree(trained / "run" / "data", tmp_path / "run" / "data")
    return tmp_path


def step(root: Path, n: int) -> Path:
    return root / "run" / "checkpoint" / f"step-{n}"


def flip_a_bit(folder: Path) -> None:
    shard = max(folder.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("marker", [b"", b"\x00\x9f{\"step\": 4, \"fi\xff"],
                         ids=["empty", "garbage"])
def test_unreadable_marker_is_an_unusable_step(run, caplog, marker):
    newest = step(run, 4)
    flip_a_bit(newest)  # loaded without its checksums, the weights would be corrupt
    (newest / MARKER).write_bytes(marker)
    with caplog.at_level(logging.WARNING, logger="torchllm"):
        resumed = Trainer(tiny_config(run, *CKPT))
    resumed.close()
    assert resumed.step == 2  # fell back
    saved, now = open_checkpoint(step(run, 2)).tensors("model."), resumed.model.state_dict()
    assert saved and all(torch.equal(now[k], v) for k, v in saved.items())
    lines = [r.getMessage() for r in caplog.records if str(newest / MARKER) in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "could not be loaded" in lines[0] and "trying an earlier one" in lines[0]
    assert ("is empty" if not marker else "is damaged") in lines[0]


def test_marker_is_fsynced_file_and_folder(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    folder = tmp_path / "step-7"
    folder.mkdir()
    mark_complete(folder, 7, {})
    # The record reaches the disk before the rename commits it; then the rename itself.
    assert synced == [str(folder / f".{MARKER}.tmp"), str(folder)]
    assert read_marker(folder)["step"] == 7
    assert not (folder / f".{MARKER}.tmp").exists()


def test_failed_resume_leaves_the_runs_config_byte_identical(run):
    config = run / "run" / "config.toml"
    before = config.read_bytes()
    proc = run_module("torchllm.train", *tiny_args(run, *CKPT), "--model.vocab_size=5000")
    assert proc.returncode == 2, proc.out[-2000:]
    (line,) = [x for x in proc.out.splitlines() if "model.vocab_size" in x]  # the key changed
    assert str(step(run, 4)) in line, line  # and the checkpoint it does not fit
    assert config.read_bytes() == before


def test_inference_uses_the_step_folders_config(run):
    from torchllm.checkpoint import Step
    from torchllm.hf.export import run_config
    from torchllm.eval.loading import load_for_inference

    # What a failed resume of earlier code left: the run's config with another vocab.
    config = run / "run" / "config.toml"
    config.write_text(config.read_text().replace("[model]\n", "[model]\nvocab_size = 5000\n"))
    assert "vocab_size = 5000" in config.read_text()
    model, cfg, _ = load_for_inference(run / "run", "cpu")
    assert cfg.model.vocab_size is None
    saved = open_checkpoint(step(run, 4)).tensors("model.")
    assert saved and all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert run_config(Step.open(step(run, 4)), []).model.vocab_size is None  # hf export


def test_retention_that_cannot_delete_names_the_folder(fresh, monkeypatch, caplog):
    real = shutil.rmtree

    def rmtree(path, ignore_errors=False, **kw):  # what a read-only folder does (not as root)
        if Path(path).name == "step-1":
            if ignore_errors:
                return
            raise PermissionError(13, "Permission denied", str(Path(path) / "__0_0.distcp"))
        return real(path, ignore_errors=ignore_errors, **kw)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with caplog.at_level(logging.WARNING, logger="torchllm"):
        Trainer(tiny_config(fresh, "--checkpoint.enable", "--job.run_name=run",
                            "--checkpoint.interval=1", "--checkpoint.keep_latest_k=1",
                            "--training.steps=3")).train()
    folder = step(fresh, 1)
    lines = [r.getMessage() for r in caplog.records if "could not delete" in r.getMessage()]
    assert len(lines) == 1 and str(folder) in lines[0] and "Permission denied" in lines[0]
    assert folder.is_dir()  # it stays, but is no longer taken for a complete checkpoint
    assert complete_steps(folder.parent) == [3]


@pytest.fixture
def probe(monkeypatch):
    """A CPU with native bf16 flags whose timed probe says what `probe.speedup` says."""
    precision.cpu_native_bf16.cache_clear()
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    calls = []

    def matmul_flops(dtype, **kw):
        calls.append(dtype)
        return 100e9 * (probe.speedup if dtype == torch.bfloat16 else 1.0)

    monkeypatch.setattr(precision, "matmul_flops", matmul_flops)
    probe.calls = calls
    yield probe
    precision.cpu_native_bf16.cache_clear()


def test_resumed_run_keeps_its_recorded_precision(fresh, probe, caplog):
    args = [*CKPT, "--training.mixed_precision=auto", "--training.steps=2"]
    probe.speedup = 4.0
    first = Trainer(tiny_config(fresh, *args))
    assert first.bf16
    first.train()
    assert read_marker(step(fresh, 2))["precision"] == "bf16"

    # Relaunched on a loaded machine: the probe would now say fp32.
    precision.cpu_native_bf16.cache_clear()
    probe.speedup, probe.calls[:] = 1.01, []
    assert precision.resolve_bf16("auto", "cpu")[0] is False
    precision.cpu_native_bf16.cache_clear()
    probe.calls[:] = []
    caplog.clear()  # the first run's precision line too, when an earlier test left INFO on
    with caplog.at_level(logging.INFO, logger="torchllm"):
        resumed = Trainer(tiny_config(fresh, *args, "--training.steps=3"))
    resumed.close()
    assert resumed.step == 2 and resumed.bf16 and probe.calls == []
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("precision:")]
    assert line.startswith("precision: bf16") and "auto" in line and "checkpoint" in line, line

    # An explicit setting wins, in one warning line.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="torchllm"):
        explicit = Trainer(tiny_config(fresh, *args, "--training.mixed_precision=none"))
    explicit.close()
    assert explicit.step == 2 and not explicit.bf16
    warned = [r for r in caplog.records if r.levelno == logging.WARNING
              and r.getMessage().startswith("precision: fp32")]
    assert len(warned) == 1  # the key and value that won, and the checkpoint's bf16 it overrides
    message = warned[0].getMessage()
    assert "training.mixed_precision = none" in message and "bf16" in message, message
    assert "checkpoint" in message, message
