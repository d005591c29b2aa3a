"""The shipped debug configs: the quick-start validates and samples (the report's validation
curve and text); the speedrun validates on all of nanoGPT's held-out 10%. (Every config
launching from a fresh clone, the Qwen3 ones saving a checkpoint the inference tools load:
test_fresh_clone.py.)"""

import pytest

from torchllm.config import load_config

from conftest import REPO


def test_the_quick_start_validates_and_samples():
    cfg = load_config(["--job.config_file", str(REPO / "train_configs/debug_model.toml")])
    assert cfg.validation.enable and 0 < cfg.validation.freq <= cfg.training.steps
    assert 0 < cfg.eval.sample_freq <= cfg.training.steps


@pytest.mark.slow
def test_speedrun_config_runs_through_run_train_sh_on_its_default_text(tmp_path):
    """train_configs/speedrun_shakespeare_cpu.toml as README/docs show it (shortened): its
    default dataset (tiny Shakespeare, shipped with the package: the same text as ../shared's)
    and the bytes tokenizer, validating on nanoGPT's held-out 10% (its whole length). The config
    is the subject, trained in this process as run_train.sh trains it; the typed command itself
    runs from a fresh clone in test_fresh_clone.py (e2e)."""
    from cli import run_train
    from conftest import shared_path

    text = shared_path("data", "tinyshakespeare.txt")
    cfg = load_config(["--job.config_file", str(REPO / "train_configs/speedrun_shakespeare_cpu.toml")])
    from torchllm.data.sources.embedded import tiny_shakespeare

    assert cfg.data.dataset == "tinyshakespeare"
    assert tiny_shakespeare() == [text.read_text()]  # the shipped copy is karpathy's text
    assert (cfg.data.tokenizer, cfg.data.val_fraction) == ("bytes", 0.1)
    proc = run_train(f"--job.dump_folder={tmp_path}", "--training.steps=3",
                     "--validation.freq=3", "--lr_scheduler.warmup_steps=1",
                     config="train_configs/speedrun_shakespeare_cpu.toml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.out
    assert "tokenizer ByteTokenizer (258 tokens)" in out
    import re

    (tokens,) = re.findall(r"validation step 3: loss [\d.]+ \| perplexity [\d.]+ \| ([\d,]+) "
                           r"tokens", out)
    held_out = len(text.read_text()) * 0.1
    assert held_out * 0.98 < int(tokens.replace(",", "")) <= held_out  # all of it, in windows
