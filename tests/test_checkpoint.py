import logging
import signal
import subprocess
import sys

import pytest
import torch

from torchllm.checkpoint import complete_steps, resolve_checkpoint
from torchllm.checkpoint.checkpointer import saved_keys
from torchllm.config import ConfigError
from torchllm.train import Trainer

from conftest import REPO, tiny_args, tiny_config

CKPT = ["--checkpoint.enable", "--job.run_name=run"]


def trainer(tmp_path, *extra):
    return Trainer(tiny_config(tmp_path, *CKPT, *extra))


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(a: Trainer, b: Trainer):
    for (name, pa), pb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(pa, pb), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    for pid in sa["state"]:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa["state"][pid][key], sb["state"][pid][key])
    assert a.lr_scheduler.state_dict()["last_epoch"] == b.lr_scheduler.state_dict()["last_epoch"]
    assert a.train_state == b.train_state


def test_resume_restores_weights_optimizer_schedule_and_counters(tmp_path, caplog):
    first = trainer(tmp_path, "--checkpoint.interval=2")
    first.train()
    assert complete_steps(tmp_path / "run" / "checkpoint") == [2, 4]
    with caplog.at_level(logging.INFO, logger="torchllm"):
        second = trainer(tmp_path, "--checkpoint.interval=2")
    assert "resumed from" in caplog.text and "step-4" in caplog.text
    assert second.step == 4 and second.train_state.tokens_seen == first.train_state.tokens_seen
    assert_same_state(first, second)
    assert second.train() == []  # nothing left to do


def test_retention_keeps_exactly_k(tmp_path):
    trainer(tmp_path, "--checkpoint.interval=1", "--checkpoint.keep_latest_k=2",
            "--training.steps=5").train()
    folder = tmp_path / "run" / "checkpoint"
    assert complete_steps(folder) == [4, 5]
    assert sorted(p.name for p in folder.iterdir()) == ["step-4", "step-5"]


def test_incomplete_checkpoint_is_ignored_with_warning(tmp_path, caplog):
    trainer(tmp_path, "--checkpoint.interval=2").train()
    folder = tmp_path / "run" / "checkpoint"
    reference = Trainer(tiny_config(tmp_path, *CKPT, "--checkpoint.load_step=2"))
    (folder / "step-4" / "COMPLETE").unlink()  # as if the save of step 4 crashed
    with caplog.at_level(logging.WARNING, logger="torchllm"):
        resumed = trainer(tmp_path)
    assert "ignoring incomplete checkpoint" in caplog.text
    assert resumed.step == 2
    assert_same_state(reference, resumed)


def test_corrupt_checkpoint_falls_back_to_earlier_one(tmp_path, caplog):
    trainer(tmp_path, "--checkpoint.interval=2").train()
    step4 = tmp_path / "run" / "checkpoint" / "step-4"
    for shard in step4.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])  # truncated
    with caplog.at_level(logging.WARNING, logger="torchllm"):
        resumed = trainer(tmp_path)
    assert "could not be loaded" in caplog.text
    assert resumed.step == 2


def test_async_save_equals_sync_save(tmp_path):
    sync = trainer(tmp_path / "s", "--checkpoint.interval=2")
    sync.train()
    asyn = trainer(tmp_path / "a", "--checkpoint.interval=2", "--checkpoint.async_mode=async")
    asyn.train()
    for step in (2, 4):
        a = tmp_path / "a" / "run" / "checkpoint" / f"step-{step}"
        s = tmp_path / "s" / "run" / "checkpoint" / f"step-{step}"
        assert saved_keys(a) == saved_keys(s)
    # Loading either gives the same state.
    assert_same_state(trainer(tmp_path / "s"), trainer(tmp_path / "a"))


def test_async_pinned_memory_needs_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(ConfigError, match="needs CUDA; on CPU use 'async'"):
        trainer(tmp_path, "--checkpoint.async_mode=async_with_pinned_mem")


def test_stop_after_steps_then_continue_matches_schedule(tmp_path):
    first = trainer(tmp_path, "--training.steps=6", "--training.stop_after_steps=3",
                    "--checkpoint.interval=100")
    assert len(first.train()) == 3
    assert complete_steps(tmp_path / "run" / "checkpoint") == [3]
    second = trainer(tmp_path, "--training.steps=6", "--training.stop_after_steps=3",
                     "--checkpoint.interval=100")
    assert second.step == 3
    lr_before = second.optimizer.param_groups[0]["lr"]
    assert lr_before == first.optimizer.param_groups[0]["lr"]  # the schedule spans 6 steps
    assert len(second.train()) == 3 and second.step == 6
    assert complete_steps(tmp_path / "run" / "checkpoint") == [3, 6]


def test_seed_checkpoint_and_initial_load_path(tmp_path):
    seed = trainer(tmp_path / "seed", "--checkpoint.create_seed_checkpoint")
    seed.train()
    step0 = tmp_path / "seed" / "run" / "checkpoint" / "step-0"
    assert saved_keys(step0) == {"model"}
    started = Trainer(tiny_config(tmp_path / "new", "--job.seed=123",
                                  f"--checkpoint.initial_load_path={tmp_path / 'seed' / 'run'}"))
    assert started.step == 0
    for (name, a), b in zip(seed.model.state_dict().items(), started.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_last_save_model_only_in_export_dtype(tmp_path):
    t = trainer(tmp_path, "--checkpoint.interval=100", "--checkpoint.last_save_model_only",
                "--checkpoint.export_dtype=bfloat16")
    t.train()
    last = resolve_checkpoint(tmp_path / "run")
    assert last.name == "step-4" and saved_keys(last) == {"model"}
    sd = {k: torch.empty(v.shape, dtype=torch.bfloat16) for k, v in t.model.state_dict().items()}
    import torch.distributed.checkpoint as dcp

    dcp.load({"model": sd}, checkpoint_id=str(last))
    for name, value in t.model.state_dict().items():
        assert torch.equal(sd[name], value.to(torch.bfloat16)), name


def test_exclude_from_loading_and_bad_entries(tmp_path):
    trainer(tmp_path, "--checkpoint.interval=2").train()
    fresh = Trainer(tiny_config(tmp_path / "x", *CKPT))
    t = trainer(tmp_path, "--checkpoint.exclude_from_loading=optimizer,lr_scheduler,train_state")
    assert t.step == 0 and t.optimizer.state_dict()["state"] == {}
    assert not torch.equal(t.model.tok_embeddings.weight, fresh.model.tok_embeddings.weight)
    with pytest.raises(ConfigError, match="exclude_from_loading = 'optimiser' must be one of"):
        trainer(tmp_path, "--checkpoint.exclude_from_loading=optimiser")


def test_load_step_must_exist(tmp_path):
    trainer(tmp_path, "--checkpoint.interval=2").train()
    with pytest.raises(ConfigError, match="no complete checkpoint at that step.*available: \\[2, 4\\]"):
        trainer(tmp_path, "--checkpoint.load_step=3")


@pytest.mark.slow
def test_sigterm_saves_current_step_and_exits_zero(tmp_path):
    args = tiny_args(tmp_path, *CKPT, "--training.steps=100000", "--checkpoint.interval=100000")
    proc = subprocess.Popen([sys.executable, "-m", "torchllm.train", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # wait until it is training
        lines.append(line)
        if "step     3/" in line:
            break
    proc.send_signal(signal.SIGTERM)
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(timeout=120) == 0, out
    assert "stopping at step" in out
    stopped_at = int(out.split("stopping at step ")[1].split(":")[0])
    assert complete_steps(tmp_path / "run" / "checkpoint") == [stopped_at]
    assert Trainer(tiny_config(tmp_path, *CKPT, "--training.steps=100000")).step == stopped_at


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_convert_round_trip_dcp_file_dcp(tmp_path, suffix):
    from torchllm.checkpoint.convert import main as convert

    t = trainer(tmp_path, "--checkpoint.interval=100")
    t.train()
    out = tmp_path / f"weights{suffix}"
    assert convert(["to-file", str(tmp_path / "run"), str(out)]) == 0
    seed = tmp_path / "seed" / "step-0"
    assert convert(["to-dcp", str(out), str(seed)]) == 0
    back = Trainer(tiny_config(tmp_path / "new", f"--checkpoint.initial_load_path={seed}"))
    for (name, a), b in zip(t.model.state_dict().items(), back.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert convert(["to-dcp", str(out), str(seed)]) == 2  # never overwrites


def test_convert_dtype_and_errors(tmp_path, capsys):
    from torchllm.checkpoint.convert import load_weights_file, main as convert

    t = trainer(tmp_path, "--checkpoint.interval=100")
    t.train()
    out = tmp_path / "w.safetensors"
    assert convert(["to-file", str(tmp_path / "run"), str(out), "--dtype", "bfloat16"]) == 0
    w = load_weights_file(out)
    assert w["tok_embeddings.weight"].dtype == torch.bfloat16
    assert convert(["to-file", str(tmp_path / "nothing"), str(out)]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert convert(["to-file", str(tmp_path / "run"), str(tmp_path / "w.bin")]) == 2
    assert convert(["to-dcp", str(out), str(tmp_path / "notastep")]) == 2


@pytest.mark.parametrize("workers", [0, 2])
def test_split_run_equals_straight_run_bit_for_bit(tmp_path, workers):
    """N steps straight == N/2, save, new process state, resume, N/2: losses and weights."""
    args = ("--training.steps=6", "--checkpoint.interval=100", "--job.deterministic",
            f"--data.num_workers={workers}")
    straight = trainer(tmp_path / "a", *args)
    straight_losses = straight.train()
    first = trainer(tmp_path / "b", *args, "--training.stop_after_steps=3")
    losses = first.train()
    torch.manual_seed(12345)  # the resumed run must not depend on the process's RNG state
    second = trainer(tmp_path / "b", *args, "--training.stop_after_steps=3")
    assert second.step == 3
    losses += second.train()
    assert losses == straight_losses
    assert_same_state(straight, second)
