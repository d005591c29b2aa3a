"""data.tokenizer = "from_initial_load" (issue 29's stage seam): a later stage takes the tokenizer
the run at checkpoint.initial_load_path trained with, as its checkpoint records it, through
./run_train.sh and the shipped stage configs; nothing to read it from is one line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import tomllib

import pytest

from torchllm.config import load_config

from conftest import REPO, tiny_args

MIDTRAIN = "train_configs/llama3_debug_midtrain.toml"
SFT = "train_configs/llama3_debug_sft.toml"


def run_train(tmp_path, *extra, config=None):
    env = {**os.environ, "NPROC": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    env.pop("NGPU", None)
    env.pop("CONFIG_FILE", None)
    if config:
        env["CONFIG_FILE"] = config
    cmd = ["./run_train.sh", *tiny_args(tmp_path, "--metrics.progress_bar=false"), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    return proc.returncode, proc.stdout + proc.stderr


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "error" in line.lower()]


def test_the_shipped_stage_configs_take_the_previous_stages_tokenizer():
    for config in (MIDTRAIN, SFT):
        cfg = load_config([f"--job.config_file={REPO / config}"])
        assert cfg.data.tokenizer == "from_initial_load" and cfg.checkpoint.initial_load_path


def test_without_initial_load_path_it_is_one_line(tmp_path):
    code, out = run_train(tmp_path, "--checkpoint.initial_load_path=", config=SFT)
    assert code == 2, out[-3000:]
    (line,) = error_lines(out)
    assert ("data.tokenizer = 'from_initial_load' takes the tokenizer of the run at "
            "checkpoint.initial_load_path, which is empty") in line, out[-3000:]


def test_a_checkpoint_that_records_no_tokenizer_is_one_line(tmp_path):
    """A checkpoint written before markers recorded the tokenizer (its COMPLETE has none)."""
    step = tmp_path / "old_run" / "checkpoint" / "step-5"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text(json.dumps({"step": 5, "time": 0}))
    code, out = run_train(tmp_path, f"--checkpoint.initial_load_path={tmp_path / 'old_run'}",
                          config=MIDTRAIN)
    assert code == 2, out[-3000:]
    (line,) = error_lines(out)
    assert f"{step / 'COMPLETE'} records no tokenizer" in line, out[-3000:]


@pytest.mark.slow
def test_run_train_sh_stages_use_the_tokenizer_their_initial_load_trained_with(tmp_path):
    """Pre-train with an 'auto' tokenizer on the user's text, then the shipped mid-training
    config with nothing but its data and initial_load_path: the same tokenizer file, plus the
    chat tokens the stage adds (the rows grow), recorded concretely in the stage's config."""
    text = tmp_path / "notes.txt"
    text.write_text("\n".join(f"Note {i}: the tide was {'high' if i % 3 else 'low'} at dawn and "
                              f"the boats went out past the {i}th buoy." for i in range(400)))
    code, out = run_train(tmp_path, f"--data.dataset=local:{text}", "--data.tokenizer=auto",
                          "--data.tokenizer_vocab_size=300", "--checkpoint.enable=true",
                          "--training.steps=1")
    assert code == 0, out[-3000:]
    (tok,) = (tmp_path / "debug_model" / "data").glob("tokenizer_*sp300.model")
    code, out = run_train(tmp_path, f"--data.sources=local:{text}=1",
                          f"--checkpoint.initial_load_path={tmp_path / 'debug_model'}",
                          "--training.steps=1", config=MIDTRAIN)
    assert code == 0, out[-3000:]
    marker = tmp_path / "debug_model" / "checkpoint" / "step-1" / "COMPLETE"
    assert f"data.tokenizer = 'from_initial_load': {tok}, as recorded in {marker}" in out, \
        out[-3000:]
    assert "vocabulary grown at load: 300 -> 306 ids" in out, out[-3000:]
    written = tomllib.loads((tmp_path / "debug_midtrain" / "config.toml").read_text())
    assert written["data"]["tokenizer"] == str(tok) and written["data"]["chat_tokens"]
