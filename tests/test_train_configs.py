"""The shipped debug configs: the quick-start validates and samples (the report's validation
curve and text), and the Qwen3 debug configs (dense and MoE) save a checkpoint that the
inference tools load."""

import pytest

from torchllm.config import load_config
from torchllm.eval.loading import load_for_inference
from torchllm.train import Trainer

from conftest import REPO

TINY = ["--training.device=cpu", "--training.steps=2", "--training.seq_len=32",
        "--training.local_batch_size=2", "--data.tokenizer_vocab_size=512",
        "--lr_scheduler.warmup_steps=1", "--metrics.log_freq=1", "--validation.steps=1",
        "--job.print_config=false"]


def test_the_quick_start_validates_and_samples():
    cfg = load_config(["--job.config_file", str(REPO / "train_configs/debug_model.toml")])
    assert cfg.validation.enable and 0 < cfg.validation.freq <= cfg.training.steps
    assert 0 < cfg.eval.sample_freq <= cfg.training.steps


@pytest.mark.slow
@pytest.mark.parametrize("config, model", [("qwen3_debug.toml", "qwen3"),
                                           ("qwen3_moe_debug.toml", "qwen3_moe")])
def test_qwen3_debug_configs_save_their_last_step(tmp_path, config, model):
    cfg = load_config(["--job.config_file", str(REPO / "train_configs" / config),
                       f"--job.dump_folder={tmp_path}", *TINY])
    assert cfg.model.name == model
    Trainer(cfg).train()
    run = tmp_path / config.removesuffix(".toml")
    assert (run / "checkpoint" / "step-2" / "COMPLETE").is_file()
    loaded, loaded_cfg, _ = load_for_inference(run, "cpu")  # what generate / evals / export do
    assert loaded_cfg.model.name == model and not loaded.training


@pytest.mark.slow
def test_speedrun_config_runs_through_run_train_sh_on_its_default_text(tmp_path):
    """train_configs/speedrun_shakespeare_cpu.toml as README/docs show it (shortened): its
    default dataset (../shared's tiny Shakespeare, relative to the checkout) and the bytes
    tokenizer, validating on nanoGPT's held-out 10% (its whole length)."""
    import os
    import subprocess

    from conftest import shared_path

    text = shared_path("data", "tinyshakespeare.txt")
    cfg = load_config(["--job.config_file", str(REPO / "train_configs/speedrun_shakespeare_cpu.toml")])
    assert cfg.data.dataset == "local:../shared/data/tinyshakespeare.txt"
    assert (REPO / cfg.data.dataset.removeprefix("local:")).resolve() == text.resolve()
    assert (cfg.data.tokenizer, cfg.data.val_fraction) == ("bytes", 0.1)
    env = dict(os.environ, CONFIG_FILE="train_configs/speedrun_shakespeare_cpu.toml", NGPU="1")
    proc = subprocess.run(
        ["./run_train.sh", f"--job.dump_folder={tmp_path}", "--training.steps=3",
         "--validation.freq=3", "--lr_scheduler.warmup_steps=1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "tokenizer ByteTokenizer (258 tokens)" in out
    import re

    (tokens,) = re.findall(r"validation step 3: loss [\d.]+ \| perplexity [\d.]+ \| ([\d,]+) "
                           r"tokens", out)
    held_out = len(text.read_text()) * 0.1
    assert held_out * 0.98 < int(tokens.replace(",", "")) <= held_out  # all of it, in windows
