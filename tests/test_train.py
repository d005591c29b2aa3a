import math
import os
import subprocess

import pytest
import torch

from torchllm.config import ConfigError
from torchllm.optim import lr_factor, param_groups
from torchllm.train import Trainer, main

from conftest import REPO, tiny_args, tiny_config


def test_lr_schedule_key_values():
    f = lambda s, kind="cosine": lr_factor(s, 100, 10, kind, 0.1, decay_ratio=0.2)  # noqa: E731
    assert f(1) == pytest.approx(0.1)  # warmup starts above zero
    assert f(5) == pytest.approx(0.5)
    assert f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.1 + 0.9 * 0.5)  # cosine midpoint
    assert f(100) == pytest.approx(0.1)
    assert f(55, "linear") == pytest.approx(1 - 0.9 * 0.5)
    assert f(100, "linear") == pytest.approx(0.1)
    assert f(80, "wsd") == pytest.approx(1.0)  # stable until the last 20%
    assert f(90, "wsd") == pytest.approx(1 - 0.9 * 0.5)
    assert f(100, "wsd") == pytest.approx(0.1)
    assert lr_factor(1, 10, 0, "cosine", 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi / 10)))


def test_scheduler_drives_optimizer_lr(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "--training.steps=6", "--optimizer.lr=1e-2"))
    lrs = []
    for _ in range(6):
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.train_step()
    expected = [1e-2 * lr_factor(s, 6, 2, "cosine", 0.1) for s in range(1, 7)]
    assert lrs == pytest.approx(expected)


def test_weight_decay_groups():
    from torchllm.models.llama.args import LlamaArgs
    from torchllm.models.llama.model import Transformer

    model = Transformer(LlamaArgs(dim=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=8))
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = param_groups(model, 0.1, decay_embeddings=False)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    decayed = {names[id(p)] for p in decay["params"]}
    assert "tok_embeddings.weight" not in decayed and "output.weight" in decayed
    assert all("norm" not in n for n in decayed)
    assert {names[id(p)] for p in no_decay["params"]} >= {"norm.weight", "tok_embeddings.weight"}
    decay, _ = param_groups(model, 0.1, decay_embeddings=True)
    assert "tok_embeddings.weight" in {names[id(p)] for p in decay["params"]}


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    big = Trainer(tiny_config(tmp_path / "a", "--training.local_batch_size=8"))
    small = Trainer(tiny_config(tmp_path / "b", "--training.local_batch_size=2",
                                "--training.global_batch_size=8"))
    assert small.grad_accum_steps == 4
    loss_big, n_big = big.forward_backward([next(big.batches)])
    loss_small, n_small = small.forward_backward([next(small.batches) for _ in range(4)])
    assert n_big == n_small
    torch.testing.assert_close(loss_big, loss_small)
    for (name, pb), ps in zip(big.model.named_parameters(), small.model.parameters()):
        torch.testing.assert_close(pb.grad, ps.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_global_batch_must_divide(tmp_path):
    with pytest.raises(ConfigError, match="global_batch_size = 6 is not a multiple"):
        Trainer(tiny_config(tmp_path, "--training.global_batch_size=6"))


def test_same_seed_same_losses_and_different_seed_differs(tmp_path):
    a = Trainer(tiny_config(tmp_path / "a", "--job.deterministic")).train()
    b = Trainer(tiny_config(tmp_path / "b", "--job.deterministic")).train()
    c = Trainer(tiny_config(tmp_path / "c", "--job.seed=7")).train()
    assert a == b
    assert a != c


def test_matches_plain_pytorch_reference_loop(tmp_path):
    """The trainer's losses equal a hand-written loop over the same batches and init."""
    cfg = tiny_config(tmp_path, "--training.max_norm=0", "--lr_scheduler.warmup_steps=0",
                      "--lr_scheduler.decay_type=linear", "--lr_scheduler.min_lr_ratio=1")
    trainer = Trainer(cfg)
    ref = type(trainer.model)(trainer.model_args)
    ref.load_state_dict(trainer.model.state_dict())
    batches = [next(trainer.batches) for _ in range(4)]
    opt = torch.optim.AdamW(
        [{"params": [p for n, p in ref.named_parameters() if p.ndim >= 2 and "tok_emb" not in n],
          "weight_decay": cfg.optimizer.weight_decay},
         {"params": [p for n, p in ref.named_parameters() if p.ndim < 2 or "tok_emb" in n],
          "weight_decay": 0.0}],
        lr=cfg.optimizer.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    ref_losses = []
    for batch in batches:
        x, y = batch["inputs"], batch["targets"]
        loss = torch.nn.functional.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    trainer.batches = iter(batches)
    losses = [trainer.train_step()["loss"] for _ in range(4)]
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_loss_is_float32_under_bf16_autocast(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "--training.mixed_precision=bf16",
                                  "--training.seq_len=16", "--training.local_batch_size=2"))
    batch = next(trainer.batches)
    with trainer.autocast():
        logits = trainer.model(batch["inputs"])
    assert logits.dtype == torch.bfloat16  # the matmuls ran in bf16 ...
    loss_sum, _ = trainer.forward_backward([batch])
    assert loss_sum.dtype == torch.float32  # ... the loss did not
    assert math.isfinite(loss_sum.item())


def test_cuda_request_without_cuda_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(ConfigError, match="no CUDA device"):
        Trainer(tiny_config(tmp_path, "--training.device=cuda"))


def test_main_writes_config_and_reports_bad_flags(tmp_path, caplog):
    assert main(tiny_args(tmp_path, "--training.steps=2", "--job.run_name=r")) == 0
    assert "[training]\nsteps = 2" in (tmp_path / "r" / "config.toml").read_text()
    assert main(tiny_args(tmp_path, "--training.lr=1")) == 2


@pytest.mark.slow
def test_run_train_sh_end_to_end(tmp_path):
    env = {**os.environ, "NGPU": "1"}
    proc = subprocess.run(
        ["./run_train.sh", "--training.steps=5", f"--job.dump_folder={tmp_path}",
         "--metrics.log_freq=1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "step     5/5" in out and "done: step 5/5, 5 steps" in out
    assert (tmp_path / "debug_model" / "config.toml").is_file()
    losses = [float(line.split("loss ")[1].split()[0]) for line in out.splitlines()
              if "| loss " in line]
    assert len(losses) == 5 and losses[-1] < losses[0]
