"""Training recipes: optimizers, batch-size and sequence-length schedules, chunked loss,
determinism (docs/recipes.md). Multi-process composition:
tests/integration/test_recipes_parallel.py."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from torchllm.config import ConfigError
from torchllm.data.seq_len_schedule import SeqLenSchedule, parse_seq_len_schedule
from torchllm.loss import IGNORE_INDEX, chunked_cross_entropy_sum, cross_entropy_sum
from torchllm.optim import lr_factor
from torchllm.optim.batch_ramp import BatchSizeRamp
from torchllm.optim.container import OptimizerList
from torchllm.train import Trainer

from conftest import tiny_config

CKPT = ["--checkpoint.enable", "--job.run_name=run", "--checkpoint.interval=100",
        "--training.steps=6", "--optimizer.lr=3e-3"]


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def straight_and_resumed(tmp_path, *extra):
    """Losses and final weights of 6 steps in one launch, and of 3 + 3 steps across a resume."""
    straight = Trainer(tiny_config(tmp_path / "a", *CKPT, *extra))
    losses = straight.train()
    first = Trainer(tiny_config(tmp_path / "b", *CKPT, "--training.stop_after_steps=3", *extra))
    resumed_losses = first.train()
    second = Trainer(tiny_config(tmp_path / "b", *CKPT, *extra))
    assert second.step == 3
    resumed_losses += second.train()
    return (losses, weights(straight.model)), (resumed_losses, weights(second.model)), second


def assert_exact_resume(tmp_path, *extra):
    (losses, w), (resumed_losses, rw), trainer = straight_and_resumed(tmp_path, *extra)
    assert resumed_losses == losses
    for name in w:
        assert torch.equal(w[name], rw[name]), name
    return losses, trainer


# ---- optimizers ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizer_trains_and_resumes_exactly(tmp_path, name):
    losses, trainer = assert_exact_resume(tmp_path, f"--optimizer.name={name}")
    assert losses[-1] < losses[0]
    assert trainer.metrics is not None and trainer.optimizer.param_groups[0]["lr"] > 0


@pytest.mark.slow
def test_adamw8bit_trains_and_resumes_exactly(tmp_path):
    """torchao compiles the 8-bit step (inductor) on CPU: slow the first time."""
    losses, trainer = assert_exact_resume(tmp_path, "--optimizer.name=adamw8bit")
    assert losses[-1] < losses[0]
    states = [v for s in trainer.optimizer.state.values() for v in s.values()]
    assert any(type(v).__name__ == "OptimState8bit" for v in states)


def test_muon_groups_and_learning_rates(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "--optimizer.name=muon", "--optimizer.lr=1e-3",
                                  "--optimizer.muon_lr=0.05", "--training.steps=6"))
    opt = trainer.optimizer
    assert isinstance(opt, OptimizerList)
    adamw, muon = opt.optimizers
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(muon, torch.optim.Muon)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    muon_names = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    adamw_names = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert muon_names and all(n.startswith("layers.") and "norm" not in n for n in muon_names)
    assert {"tok_embeddings.weight", "output.weight", "norm.weight"} <= adamw_names
    assert not muon_names & adamw_names
    assert len(muon_names | adamw_names) == len(names)
    # One schedule drives both rates, each from its own peak.
    for step in range(1, 4):
        factor = lr_factor(step, 6, 2, "cosine", 0.1)
        assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * factor)
        assert muon.param_groups[0]["lr"] == pytest.approx(0.05 * factor)
        trainer.train_state.step = step
        trainer.train_step()  # also steps the LR schedule
    # Metrics count both optimizers' state.
    from torchllm.metrics.memory import training_state_bytes
    expected = sum(v.numel() * v.element_size() for o in opt.optimizers
                   for s in o.state.values() for v in s.values() if torch.is_tensor(v))
    assert training_state_bytes(trainer.model, opt)["optimizer"] == expected > 0


def test_unknown_optimizer_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="optimizer.name"):
        Trainer(tiny_config(tmp_path, "--optimizer.name=sgd"))


# ---- schedules ----------------------------------------------------------------------------

def test_wsd_schedule_values():
    """warmup 10, stable to step 80, then linear decay to min_lr_ratio over the last 20%."""
    f = [lr_factor(s, 100, 10, "wsd", 0.0, decay_ratio=0.2) for s in range(1, 101)]
    assert f[:10] == pytest.approx([s / 10 for s in range(1, 11)])
    assert f[10:80] == pytest.approx([1.0] * 70)
    assert f[80:] == pytest.approx([1 - k / 20 for k in range(1, 21)])


class _T:  # the Training keys the ramp reads
    def __init__(self, **kw):
        self.__dict__.update(dict(batch_size_ramp_tokens=0, batch_size_ramp_start=-1,
                                  batch_size_ramp_lr_scaling=False, steps=100, seq_len=32) | kw)


def test_batch_size_ramp_values():
    """Documented example: pass 4, final 16, ramp over 2048 tokens of seq_len 32.
    Batch = start + 12 x tokens/2048 rounded down to a multiple of 4; tokens grow by batch x 32."""
    ramp = BatchSizeRamp(_T(batch_size_ramp_tokens=2048, batch_size_ramp_lr_scaling=True),
                         per_pass=4, final_batch=16)
    assert [ramp.batch(s) for s in range(1, 14)] == [4] * 6 + [8, 8, 8, 12, 12, 16, 16]
    assert [ramp.accum_steps(s) for s in (1, 7, 10, 12)] == [1, 2, 3, 4]
    assert ramp.lr_scale(1) == pytest.approx(0.5) and ramp.lr_scale(7) == pytest.approx(
        math.sqrt(0.5)) and ramp.lr_scale(50) == 1.0
    off = BatchSizeRamp(_T(), per_pass=4, final_batch=16)
    assert off.batch(1) == 16 and off.lr_scale(1) == 1.0
    with pytest.raises(ConfigError, match="batch_size_ramp_start = 6"):
        BatchSizeRamp(_T(batch_size_ramp_tokens=64, batch_size_ramp_start=6), 4, 16)


def test_seq_len_schedule_values_and_cut():
    s = SeqLenSchedule("8:0.25,16:0.5,32:1.0", seq_len=32, steps=8)
    assert [s.at(k) for k in range(1, 9)] == [8, 8, 16, 16, 32, 32, 32, 32]
    assert parse_seq_len_schedule("", 32) == [(32, 1.0)]
    tokens = torch.arange(2 * 33).reshape(2, 33)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": tokens[:, :-1]}
    cut = s.cut(batch, 1)
    assert cut["inputs"].shape == (8, 8)
    # Every (input, next token) pair of the windows is kept, in order.
    assert torch.equal(cut["inputs"].flatten(), batch["inputs"].flatten())
    assert torch.equal(cut["targets"].flatten(), batch["targets"].flatten())
    assert s.cut(batch, 8) is batch
    for bad, msg in (("12:1.0", "does not divide"), ("8:0.5,32:0.9", "end at 1.0"),
                     ("8-1.0", "not LEN:UNTIL"), ("16:0.5,8:0.5,32:1.0", "increase")):
        with pytest.raises(ConfigError, match=msg):
            parse_seq_len_schedule(bad, 32)


@pytest.mark.slow
def test_schedules_drive_training_and_resume_exactly(tmp_path):
    extra = ("--training.seq_len_schedule=16:0.5,32:1.0", "--training.global_batch_size=8",
             "--training.batch_size_ramp_tokens=256", "--training.batch_size_ramp_lr_scaling")
    losses, trainer = assert_exact_resume(tmp_path, *extra)
    assert [trainer.batch_ramp.batch(s) for s in range(1, 7)] == [4, 4, 8, 8, 8, 8]
    # The LR follows the base schedule x sqrt(batch / 8).
    fresh = Trainer(tiny_config(tmp_path / "c", *CKPT, *extra))
    seen, read = [], []
    fresh.batches = map(lambda b: read.append(b) or b, fresh.batches)
    for step in range(1, 5):
        fresh.train_state.step = step
        seen.append(fresh.optimizer.param_groups[0]["lr"])
        before = len(read)
        fresh.train_step()
        assert len(read) - before == fresh.batch_ramp.accum_steps(step)
    scale = [math.sqrt(0.5), math.sqrt(0.5), 1.0, 1.0]
    assert seen == pytest.approx([3e-3 * lr_factor(s, 6, 2, "cosine", 0.1) * scale[s - 1]
                                  for s in range(1, 5)])


# ---- chunked cross entropy ----------------------------------------------------------------

def test_chunked_cross_entropy_equals_plain_in_value_and_gradient():
    torch.manual_seed(0)
    hidden = torch.randn(2, 37, 16, requires_grad=True)
    weight = torch.randn(131, 16, requires_grad=True)
    targets = torch.randint(0, 131, (2, 37))
    targets[0, :5] = IGNORE_INDEX
    plain = cross_entropy_sum(F.linear(hidden, weight), targets)
    plain_grads = torch.autograd.grad(plain * 0.3, (hidden, weight))
    for chunk in (1, 10, 74, 1000):
        chunked = chunked_cross_entropy_sum(hidden, weight, targets, chunk)
        grads = torch.autograd.grad(chunked * 0.3, (hidden, weight))
        torch.testing.assert_close(chunked, plain)
        for g, p in zip(grads, plain_grads):
            torch.testing.assert_close(g, p, rtol=1e-5, atol=1e-6)


def test_chunked_cross_entropy_of_bf16_inputs_is_computed_in_float32():
    """bf16 hidden states and head weight outside autocast (FSDP2 with bf16 params): the chunk
    logits are upcast before the softmax, so the loss equals the float32 cross entropy of the
    bf16 logits (a bf16 log-softmax is off by ~1e-3 relative)."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 37, 16).bfloat16()
    weight = torch.randn(131, 16).bfloat16()
    targets = torch.randint(0, 131, (3, 37))
    targets[1, 4:9] = IGNORE_INDEX
    expected = F.cross_entropy(F.linear(hidden, weight).float().flatten(0, 1), targets.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    for chunk in (16, 1000):
        loss = chunked_cross_entropy_sum(hidden, weight, targets, chunk)
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss, expected, rtol=2e-6, atol=0)


@pytest.mark.parametrize("model_args", [
    ["--model.tie_embeddings=false"], ["--model.tie_embeddings=true"],
    ["--model.name=gpt2"],
])
@pytest.mark.parametrize("precision", ["none", "bf16"])
def test_chunked_loss_in_model_equals_plain(tmp_path, model_args, precision):
    """The trainer's loss and every parameter gradient, with the loss inside the model, on a
    batch with ignored (-100) targets; in fp32 and under bf16 autocast (where both paths run
    the head matmul in bf16 and the softmax in fp32: equal up to bf16 gradient rounding)."""
    extra = (*model_args, f"--training.mixed_precision={precision}")
    plain = Trainer(tiny_config(tmp_path / "p", *extra))
    chunked = Trainer(tiny_config(tmp_path / "c", *extra, "--training.chunked_loss",
                                  "--training.loss_chunk_tokens=48"))
    batch = {k: v.clone() for k, v in next(plain.batches).items()}
    batch["targets"][0, 3:20] = IGNORE_INDEX  # padding across a chunk boundary
    batch["targets"][2, -5:] = IGNORE_INDEX
    (loss, n), (chunked_loss, _) = (plain.module.train_batch([batch]),
                                    chunked.module.train_batch([batch]))
    assert n == 4 * 32 - 17 - 5
    torch.testing.assert_close(chunked_loss, loss, rtol=1e-5 if precision == "none" else 1e-3,
                               atol=0)
    for (name, a), b in zip(plain.model.named_parameters(), chunked.model.parameters()):
        if precision == "none":
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
        elif name.endswith("wk.bias"):  # zero in exact arithmetic (softmax is shift-invariant):
            assert a.grad.norm() < 1e-3 and b.grad.norm() < 1e-3  # rounding noise only
        else:  # bf16 rounds each gradient element by up to 2^-8 relative, in different places
            rel = ((b.grad - a.grad).norm() / a.grad.norm()).item()
            assert rel < 1e-2, (name, rel)


# ---- determinism --------------------------------------------------------------------------

@pytest.mark.slow
def test_deterministic_runs_are_identical_on_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        a = Trainer(tiny_config(tmp_path / "a", "--job.deterministic", "--training.steps=3"))
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.are_deterministic_algorithms_enabled()
        losses = a.train()  # train() closes the Trainer: it gives the switches back
        assert not torch.are_deterministic_algorithms_enabled()
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        b = Trainer(tiny_config(tmp_path / "b", "--job.deterministic", "--training.steps=3"))
        assert b.train() == losses
        for (name, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
            assert torch.equal(x, y), name
    finally:
        torch.use_deterministic_algorithms(False)
