"""Checkpoints under faults (issue 14): corrupted bytes, NaN/inf state, a full disk, going back
to an earlier step, a flavor change, config changes on resume, guard stops, async staging."""

from __future__ import annotations

import logging
import re
import shutil

import pytest
import torch

from torchllm.checkpoint import CheckpointSaveError, complete_steps
from torchllm.checkpoint import open_checkpoint
from torchllm.config import ConfigError
from torchllm.metrics.guard import LossGuard, TrainingStopped
from torchllm.train import Trainer, main

from conftest import tiny_args, tiny_config
from messages import assert_names, raises_naming

CKPT = ["--checkpoint.enable", "--job.run_name=run"]


def trainer(tmp_path, *extra):
    return Trainer(tiny_config(tmp_path, *CKPT, *extra))


def folder(tmp_path):
    return tmp_path / "run" / "checkpoint"


def same_tensors(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_flipped_byte_in_a_shard_falls_back_and_names_the_file(tmp_path, caplog):
    trainer(tmp_path, "--checkpoint.interval=2").train()
    shard = max((folder(tmp_path) / "step-4").glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit, in the middle of the tensor data
    shard.write_bytes(bytes(data))
    # Without checksums the flipped bit loads silently: that is what the check is for.
    assert trainer(tmp_path, "--checkpoint.checksums=false").step == 4
    with caplog.at_level(logging.WARNING, logger="torchllm"):
        resumed = trainer(tmp_path)
    assert resumed.step == 2
    assert_names(caplog.text, shard, "CRC-32")  # the file, and the check it failed


def test_nonfinite_state_is_never_marked_complete_nor_counted(tmp_path, caplog):
    t = trainer(tmp_path, "--checkpoint.interval=1", "--checkpoint.keep_latest_k=1",
                "--training.steps=2")
    t.train()
    assert complete_steps(folder(tmp_path)) == [2]
    good = open_checkpoint(folder(tmp_path) / "step-2").tensors("model.")
    # NaN in one optimizer moment only (weights finite), then inf in a weight.
    state = next(iter(t.optimizer.state.values()))
    state["exp_avg"].view(-1)[0] = float("nan")
    with caplog.at_level(logging.ERROR, logger="torchllm"):
        t.checkpointer.save(3)
    said = next(r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    assert_names(said, folder(tmp_path) / "step-3", "NaN")
    assert "1" in said.replace(str(folder(tmp_path) / "step-3"), "")  # how many tensors
    state["exp_avg"].view(-1)[0] = 0.0
    with torch.no_grad():
        t.model.tok_embeddings.weight.view(-1)[0] = float("inf")
    t.checkpointer.save(4)
    ck = folder(tmp_path)
    assert (ck / "step-3" / "NONFINITE").is_file() and (ck / "step-4" / "NONFINITE").is_file()
    # Retention (keep 1) kept the newest finite checkpoint; a resume loads it.
    assert complete_steps(ck) == [2]
    resumed = trainer(tmp_path, "--training.steps=2")
    assert resumed.step == 2
    assert same_tensors({k: v for k, v in resumed.model.state_dict().items()}, good)


def test_disk_full_before_save_is_one_line_and_keeps_earlier(tmp_path, monkeypatch):
    t = trainer(tmp_path, "--checkpoint.interval=2")
    t.train()
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr("torchllm.storage.shutil.disk_usage",
                        lambda path: usage._replace(free=1000))
    with pytest.raises(CheckpointSaveError) as err:
        t.checkpointer.save(5)
    msg = str(err.value)
    assert "\n" not in msg and str(folder(tmp_path) / "step-5") in msg
    assert_names(msg, "1.0 KB")  # what is free, and what the save needs:
    assert re.search(r"\d[\d.]* MB", msg), msg
    assert not (folder(tmp_path) / "step-5").exists()
    assert complete_steps(folder(tmp_path)) == [2, 4]


def test_write_error_stops_with_exit_4_or_continues_and_retries(tmp_path, monkeypatch, caplog,
                                                                 capfd):
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    real = FileSystemWriter.write_data
    fail = {"left": 1}

    def flaky(self, plan, planner):
        if fail["left"]:
            fail["left"] -= 1
            raise OSError(28, "No space left on device")
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", flaky)
    args = tiny_args(tmp_path, *CKPT, "--checkpoint.interval=2")
    assert main(args) == 4  # the first save (step 2) fails: the run stops non-zero
    out = capfd.readouterr()
    line = next(x for x in (out.out + out.err).splitlines() if "could not be saved" in x)
    assert_names(line, "step-2", "No space left on device", "removed")  # the step, the OS cause
    assert not (folder(tmp_path) / "step-2").exists()
    logging.getLogger("torchllm").handlers.clear()  # main() installed its console handler
    logging.getLogger("torchllm").propagate = True  # and stopped propagation to caplog
    fail["left"] = 1
    shutil.rmtree(tmp_path / "run")
    with caplog.at_level(logging.ERROR, logger="torchllm"):
        t = trainer(tmp_path, "--checkpoint.interval=2", "--checkpoint.on_save_error=continue",
                    "--job.overwrite")  # the failed run left its TensorBoard events
        assert len(t.train()) == 4
    assert "training continues" in caplog.text
    assert complete_steps(folder(tmp_path)) == [4]


def test_load_step_moves_newer_aside_and_relaunch_continues_the_new_line(tmp_path, caplog):
    trainer(tmp_path, "--checkpoint.interval=1", "--checkpoint.keep_latest_k=2").train()
    ck = folder(tmp_path)
    assert complete_steps(ck) == [3, 4]
    with caplog.at_level(logging.INFO, logger="torchllm"):
        back = trainer(tmp_path, "--checkpoint.interval=1", "--checkpoint.keep_latest_k=2",
                       "--checkpoint.load_step=3", "--training.stop_after_steps=1")
    assert back.step == 3 and f"resumed from {ck / 'step-3'}" in caplog.text
    aside = [p for p in ck.iterdir() if p.name.startswith("abandoned-")]
    assert len(aside) == 1 and complete_steps(aside[0]) == [4]  # moved, complete, not deleted
    back.train()
    assert complete_steps(ck) == [3, 4]  # the new line's step 4; step 3 not purged for it
    assert trainer(tmp_path, "--checkpoint.interval=1").step == 4
    assert complete_steps(aside[0]) == [4]


def test_flavor_change_names_parameter_and_both_shapes(tmp_path):
    trainer(tmp_path, "--training.steps=1").train()
    with pytest.raises(ConfigError) as err:
        trainer(tmp_path, "--training.steps=1", "--model.dim=128")
    msg = str(err.value)
    assert_names(msg, "model.tok_embeddings.weight", "[512, 256]", "[512, 128]")
    assert msg.index("[512, 256]") < msg.index("[512, 128]")  # saved, then expected
    assert str(folder(tmp_path) / "step-1" / ".metadata") in msg
    # A vocabulary change names the checkpoint, both row counts (600 pads to 640), the keys, and
    # the way to grow a vocabulary.
    with raises_naming(ConfigError, folder(tmp_path) / "step-1", "512", "640", "model.vocab_size",
                       "checkpoint.initial_load_path"):
        trainer(tmp_path, "--training.steps=1", "--model.vocab_size=600")
    with pytest.raises(ConfigError, match="unexpected: model.output.weight"):
        trainer(tmp_path, "--training.steps=1", "--model.tie_embeddings=true")


def test_config_changes_on_resume_are_listed_and_lr_can_come_from_config(tmp_path, caplog):
    common = ("--training.steps=4", "--training.stop_after_steps=2")
    trainer(tmp_path, *common).train()
    with caplog.at_level(logging.WARNING, logger="torchllm"):
        kept = trainer(tmp_path, *common, "--optimizer.lr=0.001", "--training.steps=8")
    said = next(r.getMessage() for r in caplog.records if "optimizer.lr" in r.getMessage())
    assert_names(said, "config.toml")  # the changes since the checkpoint's config (keys sorted)
    lr = said[said.index("optimizer.lr"):said.index("training.steps")]
    steps = said[said.index("training.steps"):]
    # Each change names both values; the kept one names the key that applies the new value.
    assert_names(lr, "0.0003", "0.001", "checkpoint.optimizer_hparams_from")
    assert_names(steps, "4", "8")
    assert "checkpoint.optimizer_hparams_from" not in steps
    # Oracle: a fresh run with the new config, its schedule stepped twice.
    fresh = Trainer(tiny_config(tmp_path / "fresh", "--optimizer.lr=0.001", "--training.steps=8"))
    fresh.lr_scheduler.step()
    fresh.lr_scheduler.step()
    new = trainer(tmp_path, *common, "--optimizer.lr=0.001", "--training.steps=8",
                  "--checkpoint.optimizer_hparams_from=config")
    assert new.step == kept.step == 2
    assert new.optimizer.param_groups[0]["lr"] == pytest.approx(fresh.optimizer.param_groups[0]["lr"])
    assert kept.optimizer.param_groups[0]["initial_lr"] == pytest.approx(3e-4)
    assert new.lr_scheduler.get_last_lr() == [g["lr"] for g in new.optimizer.param_groups]
    with raises_naming(ConfigError, "training.global_batch_size = 4",  # the saved batch
                       "checkpoint.allow_global_batch_change"):
        trainer(tmp_path, *common, "--training.local_batch_size=2")
    assert trainer(tmp_path, *common, "--training.local_batch_size=2",
                   "--checkpoint.allow_global_batch_change").step == 2


@pytest.mark.slow
def test_guard_stop_then_resume_equals_skipping_that_step(tmp_path, monkeypatch):
    """A guard stop saves the dropped step; resuming continues exactly as `skip_step` would."""
    real = LossGuard.problem

    def flag_step_3(self, loss, grad_norm):
        self.calls = getattr(self, "calls", 0) + 1
        return ("spikes", "forced for the test") if self.calls == 3 else real(self, loss, grad_norm)

    args = ("--training.steps=6", "--checkpoint.interval=100", "--job.deterministic",
            "--lr_scheduler.warmup_steps=4")
    monkeypatch.setattr(LossGuard, "problem", flag_step_3)
    skipped = trainer(tmp_path / "a", *args, "--metrics.guard_policy=skip_step")
    skipped_losses = skipped.train()
    stopped = trainer(tmp_path / "b", *args, "--metrics.guard_policy=stop")
    with pytest.raises(TrainingStopped):
        stopped.train()
    assert complete_steps(folder(tmp_path / "b")) == [3]
    monkeypatch.setattr(LossGuard, "problem", real)
    resumed = trainer(tmp_path / "b", *args, "--metrics.guard_policy=stop")
    assert resumed.train() == skipped_losses[3:]
    assert resumed.optimizer.param_groups[0]["lr"] == skipped.optimizer.param_groups[0]["lr"]
    assert resumed.train_state == skipped.train_state and resumed.guard.counts == skipped.guard.counts
    for (name, a), b in zip(skipped.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_two_async_saves_equal_sync_saves_with_a_one_shot_stager(tmp_path, monkeypatch):
    """torch < 2.13's DefaultStager works once (pytorch#183413): emulate that; every async
    save must still write exactly what a synchronous save writes, at both steps."""
    from torch.distributed.checkpoint import staging

    class OneShotStager(staging.DefaultStager):
        def stage(self, state_dict, **kwargs):
            if getattr(self, "used", False):
                raise RuntimeError("StateDictStager is closed (pytorch#183413)")
            self.used = True
            return super().stage(state_dict, **kwargs)

    monkeypatch.setattr(staging, "DefaultStager", OneShotStager)
    trainer(tmp_path / "s", "--checkpoint.interval=2").train()
    trainer(tmp_path / "a", "--checkpoint.interval=2", "--checkpoint.async_mode=async").train()
    for step in (2, 4):
        a, s = (folder(tmp_path / r) / f"step-{step}" for r in ("a", "s"))
        for prefix in ("model.", "optimizer."):
            assert same_tensors(open_checkpoint(a).tensors(prefix),
                                open_checkpoint(s).tensors(prefix)), step


def test_rng_state_saves_only_this_ranks_cuda_generator(monkeypatch):
    from torchllm.checkpoint.state import RNGState

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.tensor([7]))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all",
                        lambda: pytest.fail("saved every visible GPU's generator"))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": calls.append(s))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all",
                        lambda s: pytest.fail("restored every visible GPU's generator"))
    state = RNGState().state_dict()
    assert torch.equal(state["cuda"], torch.tensor([7]))
    RNGState().load_state_dict(state)
    RNGState().load_state_dict({**state, "cuda": [torch.tensor([0]), torch.tensor([1])]})
    assert [int(c) for c in calls] == [7, 1]  # an old all-GPU list: this rank's entry only

