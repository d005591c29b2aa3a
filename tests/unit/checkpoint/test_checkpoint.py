import logging
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch

from torchllm.checkpoint import complete_steps, resolve_checkpoint
from torchllm.checkpoint.step import Step
from torchllm.config import ConfigError
from torchllm.optim import lr_factor
from torchllm.train import Trainer

from conftest import REPO, tiny_args, tiny_config

CKPT = ["--checkpoint.enable", "--job.run_name=run"]


def trainer(tmp_path, *extra):
    return Trainer(tiny_config(tmp_path, *CKPT, *extra))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(folder, losses): a finished 4-step run `run` with checkpoints at steps 2 and 4, which
    the tests below copy (`straight_run`) instead of each training its own."""
    root = tmp_path_factory.mktemp("trained")
    return root, trainer(root, "--checkpoint.interval=2").train()


@pytest.fixture
def straight_run(trained, tmp_path):
    """`trained`'s run, copied to tmp_path (its losses)."""
    shutil.copytree(trained[0], tmp_path, dirs_exist_ok=True)
    return trained[1]


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


def test_incomplete_checkpoint_is_ignored_with_warning(straight_run, tmp_path, caplog):
    folder = tmp_path / "run" / "checkpoint"
    # The reference loads a copy of step 2 (load_step = 2 would move step 4 aside).
    shutil.copytree(folder / "step-2", tmp_path / "ref" / "checkpoint" / "step-2")
    reference = Trainer(tiny_config(tmp_path, "--checkpoint.enable", "--job.run_name=ref"))
    (folder / "step-4" / "COMPLETE").unlink()  # as if the save of step 4 crashed
    with caplog.at_level(logging.WARNING, logger="torchllm"):
        resumed = trainer(tmp_path)
    assert "ignoring incomplete checkpoint" in caplog.text
    assert resumed.step == 2
    assert_same_state(reference, resumed)


def test_corrupt_checkpoint_falls_back_to_earlier_one(straight_run, tmp_path, caplog):
    straight = straight_run
    step4 = tmp_path / "run" / "checkpoint" / "step-4"
    for shard in step4.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])  # truncated
    with caplog.at_level(logging.WARNING, logger="torchllm"):
        resumed = trainer(tmp_path)
    assert "could not be loaded" in caplog.text
    assert resumed.step == 2
    assert resumed.train() == straight[2:]  # steps 3 and 4 again, bit for bit


def all_tensors(step_dir) -> dict:
    """Every tensor of a checkpoint (weights, optimizer moments and steps, RNG states)."""
    from torchllm.checkpoint import open_checkpoint

    return open_checkpoint(step_dir).tensors("")


def test_async_save_equals_sync_save(tmp_path):
    """Every async checkpoint equals the sync one of the same step, tensor by tensor. Staging
    is slowed down so that the step after a save runs its forward and backward while the copy
    is still in flight: the optimizer must wait for it (Checkpointer.wait_for_staging)."""
    args = ("--checkpoint.interval=2", "--training.steps=5")
    sync = trainer(tmp_path / "s", *args)
    sync_losses = sync.train()
    asyn = trainer(tmp_path / "a", *args, "--checkpoint.async_mode=async")
    stepped = threading.Event()  # an optimizer step finished
    asyn.optimizer.register_step_post_hook(lambda *_: stepped.set())
    staged_at = []

    class SlowStager(asyn.checkpointer.saver._stager_cls):  # the checkpointer makes one per save
        def _stage(self, state_dict, **kwargs):
            # Copy only after the next optimizer step, if it does not wait for us (the bug),
            # else after 1.5 s, by when the next step's forward and backward have run.
            stepped.clear()
            stepped.wait(timeout=1.5)
            staged_at.append(asyn.step)  # the step running when the copy was made
            return super()._stage(state_dict, **kwargs)

    asyn.checkpointer.saver._stager_cls = SlowStager
    assert asyn.train() == sync_losses
    assert staged_at == [3, 5, 5]  # saves of steps 2 and 4 overlapped the next step
    for step in (2, 4, 5):
        a = tmp_path / "a" / "run" / "checkpoint" / f"step-{step}"
        s = tmp_path / "s" / "run" / "checkpoint" / f"step-{step}"
        assert Step.open(a).states == Step.open(s).states
        expected = all_tensors(s)
        got = all_tensors(a)
        assert sorted(got) == sorted(expected) and len(expected) > 20
        for key, value in expected.items():
            assert torch.equal(got[key], value), (step, key)
    # Loading either gives the same state.
    assert_same_state(trainer(tmp_path / "s", *args), trainer(tmp_path / "a", *args))


def test_async_pinned_memory_needs_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(ConfigError) as e:
        trainer(tmp_path, "--checkpoint.async_mode=async_with_pinned_mem")
    msg = str(e.value)  # the key, the value refused, and the value to use on CPU
    assert e.value.key == "checkpoint.async_mode" and "CUDA" in msg and "'async'" in msg, msg


def lrs_of(t: Trainer) -> list[float]:
    """Run t.train() and return the LR each of its steps used."""
    lrs, step = [], t.train_step

    def recording_step():
        m = step()
        lrs.append(m["lr"])
        return m

    t.train_step = recording_step
    t.train()
    return lrs


def test_stop_after_steps_then_continue_matches_schedule(tmp_path):
    """The schedule spans all 6 steps across the two launches: the scheduler's own state is
    restored (not just the LR the optimizer's param groups carry) and steps 4-6 use the LRs of
    the formula."""
    first = trainer(tmp_path, "--training.steps=6", "--training.stop_after_steps=3",
                    "--checkpoint.interval=100")
    assert lrs_of(first) == pytest.approx([3e-4 * lr_factor(s, 6, 2, "cosine", 0.1)
                                           for s in (1, 2, 3)])
    assert complete_steps(tmp_path / "run" / "checkpoint") == [3]
    second = trainer(tmp_path, "--training.steps=6", "--training.stop_after_steps=3",
                     "--checkpoint.interval=100")
    assert second.step == 3
    assert second.lr_scheduler.state_dict() == first.lr_scheduler.state_dict()
    assert second.lr_scheduler.last_epoch == 3
    assert lrs_of(second) == pytest.approx([3e-4 * lr_factor(s, 6, 2, "cosine", 0.1)
                                            for s in (4, 5, 6)])
    assert second.step == 6
    assert complete_steps(tmp_path / "run" / "checkpoint") == [3, 6]


def test_seed_checkpoint_and_initial_load_path(tmp_path):
    seed = trainer(tmp_path / "seed", "--checkpoint.create_seed_checkpoint")
    seed.train()
    step0 = tmp_path / "seed" / "run" / "checkpoint" / "step-0"
    assert Step.open(step0).states == {"model"}
    started = Trainer(tiny_config(tmp_path / "new", "--job.seed=123",
                                  f"--checkpoint.initial_load_path={tmp_path / 'seed' / 'run'}"))
    assert started.step == 0
    for (name, a), b in zip(seed.model.state_dict().items(), started.model.state_dict().values()):
        assert torch.equal(a, b), name


def tokenizer_of(t: Trainer) -> str:
    """--data.tokenizer= the tokenizer `t` trained, so that later trainers skip training one."""
    (path,) = (t.run_dir / "data").glob("tokenizer_*.model")
    return f"--data.tokenizer={path}"


def test_initial_load_model_only_or_full_state(tmp_path):
    """initial_load_model_only (default): a new run takes the weights of another run's step-2
    and nothing else (fresh optimizer, schedule, step, data order). With false, it takes the whole
    state and continues exactly like that run: its steps 3-4 repeat the source's losses."""
    src = trainer(tmp_path / "src", "--checkpoint.interval=2")
    src_losses = src.train()
    tok = tokenizer_of(src)
    step2 = tmp_path / "src" / "run" / "checkpoint" / "step-2"
    source = Trainer(tiny_config(tmp_path / "src", *CKPT, tok, "--checkpoint.load_step=2"))
    weights_only = Trainer(tiny_config(tmp_path / "w", tok,
                                       f"--checkpoint.initial_load_path={step2}"))
    assert weights_only.step == 0 and weights_only.optimizer.state_dict()["state"] == {}
    assert weights_only.lr_scheduler.last_epoch == 0
    assert weights_only.train_loader.state_dict() != source.train_loader.state_dict()
    for (name, a), b in zip(source.model.state_dict().items(),
                            weights_only.model.state_dict().values()):
        assert torch.equal(a, b), name

    full = Trainer(tiny_config(tmp_path / "f", tok, f"--checkpoint.initial_load_path={step2}",
                               "--checkpoint.initial_load_model_only=false"))
    assert full.step == 2 and full.lr_scheduler.last_epoch == 2
    assert full.train_loader.state_dict() == source.train_loader.state_dict()
    assert_same_state(source, full)
    assert full.train() == src_losses[2:]


def test_last_save_model_only_in_export_dtype(tmp_path):
    t = trainer(tmp_path, "--checkpoint.interval=100", "--checkpoint.last_save_model_only",
                "--checkpoint.export_dtype=bfloat16")
    t.train()
    last = resolve_checkpoint(tmp_path / "run")
    assert last.name == "step-4" and Step.open(last).states == {"model"}
    sd = {k: torch.empty(v.shape, dtype=torch.bfloat16) for k, v in t.model.state_dict().items()}
    Step.open(last).read({"model": sd})
    for name, value in t.model.state_dict().items():
        assert torch.equal(sd[name], value.to(torch.bfloat16)), name


def test_exclude_from_loading_and_bad_entries(straight_run, tmp_path):
    fresh = Trainer(tiny_config(tmp_path / "x", *CKPT))
    t = trainer(tmp_path, "--checkpoint.exclude_from_loading=optimizer,lr_scheduler,train_state")
    assert t.step == 0 and t.optimizer.state_dict()["state"] == {}
    assert not torch.equal(t.model.tok_embeddings.weight, fresh.model.tok_embeddings.weight)
    with pytest.raises(ConfigError) as e:
        trainer(tmp_path, "--checkpoint.exclude_from_loading=optimiser")
    msg = str(e.value)  # the key, the value, and the entries allowed
    assert "checkpoint.exclude_from_loading" in msg and "'optimiser'" in msg, msg
    assert "'optimizer'" in msg and "'lr_scheduler'" in msg, msg


def test_load_step_must_exist(straight_run, tmp_path):
    with pytest.raises(ConfigError) as e:
        trainer(tmp_path, "--checkpoint.load_step=3")
    msg = str(e.value)  # the key, the step asked for, the folder, and the steps there are
    assert e.value.key == "checkpoint.load_step" and "= 3" in msg and "[2, 4]" in msg, msg
    assert str(tmp_path / "run" / "checkpoint") in msg, msg


@pytest.mark.slow
def test_sigterm_saves_current_step_and_exits_zero(tmp_path):
    # A process: the test signals it (SIGTERM while training) and checks its exit code.
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
    from torchllm.hf.convert import main as convert

    t = trainer(tmp_path, "--checkpoint.interval=100")
    t.train()
    out = tmp_path / f"weights{suffix}"
    assert convert(["to-file", str(tmp_path / "run"), str(out)]) == 0
    seed = tmp_path / "seed" / "step-0"
    assert convert(["to-dcp", str(out), str(seed)]) == 0
    # A weights file records no tokenizer: the new run names it (else a one-line error).
    back = Trainer(tiny_config(tmp_path / "new", f"--checkpoint.initial_load_path={seed}",
                               f"--data.tokenizer={t.tokenizer.path}"))
    for (name, a), b in zip(t.model.state_dict().items(), back.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert convert(["to-dcp", str(out), str(seed)]) == 2  # never overwrites


def test_convert_dtype_and_errors(tmp_path, capsys):
    from torchllm.hf.convert import load_weights_file, main as convert

    t = trainer(tmp_path, "--checkpoint.interval=100")
    t.train()
    out = tmp_path / "w.safetensors"
    assert convert(["to-file", str(tmp_path / "run"), str(out), "--dtype", "bfloat16"]) == 0
    w = load_weights_file(out)
    assert w["tok_embeddings.weight"].dtype == torch.bfloat16
    assert convert(["to-file", str(tmp_path / "nothing"), str(tmp_path / "w2.safetensors")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert convert(["to-file", str(tmp_path / "run"), str(tmp_path / "w.bin")]) == 2
    assert convert(["to-dcp", str(out), str(tmp_path / "notastep")]) == 2


@pytest.mark.parametrize("workers", [0, 2])
def test_split_run_equals_straight_run_bit_for_bit(tmp_path, workers):
    """N steps straight == N/2, save, new process state, resume, N/2: losses and weights.

    model.dropout draws from the torch RNG every step, so the RNG state saved with the
    checkpoint decides the resumed run's masks: without restoring it the losses differ."""
    args = ("--training.steps=6", "--checkpoint.interval=100", "--job.deterministic",
            f"--data.num_workers={workers}", "--model.dropout=0.2")
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
    if workers == 0:  # the masks really depend on the restored state
        third = trainer(tmp_path / "b", *args, "--checkpoint.load_step=3",
                        "--checkpoint.exclude_from_loading=rng")
        assert third.step == 3 and third.train() != straight_losses[3:]
