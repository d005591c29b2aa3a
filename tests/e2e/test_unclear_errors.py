"""One actionable line instead of a traceback or advice that repeats the failed command (issue
52, "Unclear errors"): another model family named over a checkpoint in generate / eval /
export, a job.seed numpy cannot take, and LoRA from a checkpoint whose adapters do not fit."""

from __future__ import annotations

import pytest

from torchllm.config import ConfigError, load_config
from torchllm.train import Trainer

from conftest import tiny_args


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 1-step llama3 run ("base") and a 1-step LoRA (rank 8) run from it ("lora")."""
    tmp = tmp_path_factory.mktemp("runs")
    common = ("--data.dataset=embedded", "--training.steps=1", "--checkpoint.enable")
    Trainer(load_config(tiny_args(tmp, "--job.run_name=base", *common))).train()
    Trainer(load_config(tiny_args(tmp, "--job.run_name=lora", *common, "--lora.enable",
                                  f"--checkpoint.initial_load_path={tmp / 'base'}"))).train()
    return tmp


@pytest.mark.parametrize("name", ["qwen3", "gpt2"])
def test_another_family_over_a_checkpoint_is_one_line(runs, capsys, name):
    """`--model.name` of another family: generate and hf export exit 2 with one line naming
    both families (was a CheckpointException / KeyError traceback); the eval tools' loader
    raises the same ConfigError."""
    from torchllm.eval.loading import load_for_inference
    from torchllm.generate import main as generate
    from torchllm.hf.cli import main as hf_cli

    run = runs / "base"
    assert generate(["--checkpoint", str(run), "--prompt", "hi", "--max-new-tokens", "2",
                     f"--model.name={name}"]) == 2
    assert hf_cli(["export", "--checkpoint", str(run), "--out", str(runs / f"hf_{name}"),
                   f"--model.name={name}"]) == 2
    for err in capsys.readouterr().err.strip().splitlines()[-2:]:  # the key, both families
        assert "model.name" in err and repr(name) in err and "'llama3'" in err, err
    assert not (runs / f"hf_{name}").exists()
    with pytest.raises(ConfigError) as e:
        load_for_inference(run, "cpu", [f"--model.name={name}"])
    msg = str(e.value)
    assert "model.name" in msg and repr(name) in msg and "'llama3'" in msg and "\n" not in msg


@pytest.mark.parametrize("seed", ["99999999999999999999", "-1", "4294967296"])
def test_a_seed_numpy_cannot_take_is_a_config_error_at_check_time(tmp_path, seed):
    """run_train.sh's check (launch.check_config) refuses it, naming job.seed (it passed the
    check, then crashed in np.random.seed)."""
    from torchllm.run.launch import check_config

    with pytest.raises(ConfigError) as e:
        check_config(tiny_args(tmp_path, f"--job.seed={seed}"), 1)
    msg = str(e.value)  # the key, the value, and the range allowed
    assert f"job.seed = {seed}" in msg and "4294967295" in msg and "\n" not in msg, msg
    assert load_config(tiny_args(tmp_path, "--job.seed=4294967295")).job.seed == 2**32 - 1


def test_lora_of_another_rank_from_a_lora_checkpoint_gets_other_advice(runs):
    """A new LoRA run (rank 4) from a rank-8 LoRA checkpoint (checkpoint.initial_load_path):
    the line names the key and advises what is not the command just run (it advised
    `checkpoint.initial_load_path`): keep the rank, or start from an hf export of it."""
    cfg = load_config(tiny_args(runs, "--job.run_name=lora4", "--data.dataset=embedded",
                                "--lora.enable", "--lora.rank=4",
                                f"--checkpoint.initial_load_path={runs / 'lora'}"))
    with pytest.raises(ConfigError) as e:
        Trainer(cfg)
    message = str(e.value)
    assert "\n" not in message
    assert "lora.rank = 8" in message and "4" in message, message  # the key, both ranks
    assert "python -m torchllm.hf export --checkpoint" in message, message
    assert "start a new run from it (checkpoint.initial_load_path)" not in message, message


def test_lora_from_a_base_checkpoint_that_does_not_fit_names_the_shapes(runs):
    """LoRA from a non-LoRA checkpoint of another depth: the misfit is the shapes (named),
    not lora.enable (it advised `set lora.enable = False ... or start a new run from it
    (checkpoint.initial_load_path)`, the command just run)."""
    cfg = load_config(tiny_args(runs, "--job.run_name=deeper", "--data.dataset=embedded",
                                "--lora.enable", "--model.n_layers=2",
                                f"--checkpoint.initial_load_path={runs / 'base'}"))
    with pytest.raises(ConfigError) as e:
        Trainer(cfg)
    message = str(e.value)
    assert "model.layers.2." in message and str(runs / "base") in message, message
    assert "lora.enable" not in message, message
