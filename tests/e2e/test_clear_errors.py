"""Errors and warnings a new user met (issue 53), through the commands they type: a missing
validation.dataset named as itself, a folder of mixed files, the tools' --help, a worker's config
error printed once, evals offline failing at once (never ~25 s of Hub retries), `_local` harness
tasks that never reach the Hub, the eval data fetched (prepared from a file) by one command, and
the shipped SFT config on a small chat file warning of its epochs and its empty validation split.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from cli import run_module, run_train
from conftest import REPO, SHARED, tiny_args
from builders.chat import write_chat

pytestmark = pytest.mark.slow

UNREACHABLE = "http://127.0.0.1:9"  # no Hub here: a refused connection, at once
HELLASWAG_ROW = {"ind": 0, "activity_label": "Cooking", "ctx_a": "A man cracks an egg.",
                 "ctx_b": "he", "ctx": "A man cracks an egg. he",
                 "endings": ["fries it.", "sings.", "flies away.", "reads a book."],
                 "split": "val", "split_type": "indomain", "label": "0"}
ENV = {"HF_ENDPOINT": UNREACHABLE}  # each command's environment, for its call only


@pytest.fixture(autouse=True)
def hub_as_a_new_process_finds_it(monkeypatch):
    """Each command starts as a new process would: no offline switch in the environment (the
    user's own), and torchllm.hub's probe not yet made (its answer and the offline switches it
    flips are per process): both put back afterwards."""
    import huggingface_hub.constants as hub_constants

    from torchllm import hub

    for key in ("NGPU", "CONFIG_FILE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(hub, "_state", {})
    offline = hub_constants.HF_HUB_OFFLINE
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", offline)
    datasets_config = sys.modules.get("datasets.config")
    saved = datasets_config and (datasets_config.HF_HUB_OFFLINE,
                                 datasets_config.HF_DATASETS_OFFLINE)
    yield
    datasets_config = sys.modules.get("datasets.config")  # set_offline flips its switches too
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE, datasets_config.HF_DATASETS_OFFLINE = (
            saved or (offline, offline))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    r = run_module("torchllm.train", *tiny_args(tmp, "--job.run_name=r", "--checkpoint.enable",
                                                "--training.steps=1"), env=ENV)
    assert r.returncode == 0, r.out[-3000:]
    return tmp / "r"


@pytest.mark.parametrize("how", ["run_train.sh", "torchllm.train"])
def test_a_missing_validation_dataset_is_named_as_validation_dataset(tmp_path, how):
    args = tiny_args(tmp_path, "--validation.enable",
                     f"--validation.dataset=local:{tmp_path}/no.txt")
    if how == "run_train.sh":  # the launcher's pre-flight check, before any rank starts
        r = run_train(*args, env=ENV)
    else:  # a rank building its validation set
        r = run_module("torchllm.train", *args, env=ENV)
    assert r.returncode == 2, r.out[-3000:]
    lines = [ln for ln in r.out.splitlines() if "no.txt" in ln]
    assert lines and all("validation.dataset" in ln and "data.dataset" not in ln
                         for ln in lines), r.out[-3000:]


def test_a_folder_of_mixed_files_says_how_to_read_it(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("some text " * 50)
    (tmp_path / "d" / "b.jsonl").write_text(json.dumps({"text": "more text"}) + "\n")
    r = run_module("torchllm.train", *tiny_args(tmp_path, f"--data.dataset=local:{tmp_path}/d"),
                   env=ENV)
    assert r.returncode == 2, r.out[-3000:]
    (line,) = [ln for ln in r.out.splitlines() if f"{tmp_path}/d" in ln]
    # what is there, and the two ways to read it: one kind by a glob, or a mixture
    assert ".jsonl" in line and ".txt" in line and f"local:{tmp_path}/d/*.jsonl" in line
    assert "[[data.sources]]" in line


@pytest.mark.parametrize("tool", ["model_info", "estimate_memory"])
def test_the_tools_answer_help(tool):
    r = run_module(f"torchllm.tools.{tool}", "--help", env=ENV)
    assert r.returncode == 0, r.out
    assert f"python -m torchllm.tools.{tool}" in r.stdout and "--section.key" in r.stdout


def test_a_workers_config_error_is_printed_once(tmp_path):
    r = run_train(*tiny_args(tmp_path, "--data.tokenizer=nobody/none"),
                  env={**ENV, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2, r.out[-3000:]
    # once: by the launcher, naming the rank, the key and the value (not again by the rank)
    (line,) = [ln for ln in r.out.splitlines() if "nobody/none" in ln]
    assert line.startswith("run_train:") and "rank 0" in line, r.out[-3000:]
    assert "data.tokenizer" in line and "config error" in line, line


def test_hellaswag_offline_fails_at_once_saying_so(checkpoint):
    r = run_module("torchllm.eval.hellaswag", "--checkpoint", str(checkpoint), "--limit", "2",
                   env=ENV)
    assert r.returncode == 2, r.out[-3000:]
    # the probe (3 s), then the local cache only: no retries of an unreachable Hub
    assert f"{UNREACHABLE} could not be reached (Connection refused)" in r.out, r.out[-3000:]


def test_downstream_offline_fails_at_once_naming_the_fetch_command(checkpoint, tmp_path):
    r = run_module("torchllm.eval.downstream", "--checkpoint", str(checkpoint), "--tasks",
                   "copa", "--data-dir", str(tmp_path), "--limit", "2", env=ENV)
    assert r.returncode == 2, r.out[-3000:]
    assert f"{UNREACHABLE} could not be reached (Connection refused)" in r.out, r.out[-3000:]
    assert "python -m torchllm.eval.fetch" in r.out


def test_local_harness_tasks_never_reach_the_hub(checkpoint, tmp_path):
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm-eval is not installed (pip install -e '.[harness]')")
    r = run_module("torchllm.eval.harness", "--checkpoint", str(checkpoint), "--tasks",
                   "arc_easy_local", "--data-dir", str(tmp_path / "none"), "--limit", "2",
                   env=ENV)
    assert r.returncode == 2, r.out[-3000:]
    assert str(tmp_path / "none" / "arc_easy") in r.out and "torchllm.eval.fetch" in r.out
    assert "allenai/ai2_arc" not in r.out and "did not answer" not in r.out


def test_one_command_prepares_the_eval_data_the_evals_read_offline(checkpoint, tmp_path):
    official = tmp_path / "hellaswag_val.jsonl"
    official.write_text("".join(json.dumps({**HELLASWAG_ROW, "ind": i}) + "\n"
                                for i in range(6)))
    evals = tmp_path / "data" / "evals"
    r = run_module("torchllm.eval.fetch", "--out", str(evals), "--tasks", "hellaswag",
                   "--from", f"hellaswag={official}", env=ENV)
    assert r.returncode == 0, r.out
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("hellaswag:")]
    assert "6 rows" in line and (evals / "hellaswag.jsonl").is_file(), r.out
    # The docs' offline commands, on what it wrote.
    r = run_module("torchllm.eval.downstream", "--checkpoint", str(checkpoint), "--tasks",
                   "hellaswag", "--data-dir", str(evals), "--limit", "4", env=ENV)
    assert r.returncode == 0, r.out[-3000:]
    r = run_module("torchllm.eval.hellaswag", "--checkpoint", str(checkpoint), "--data",
                   str(evals / "hellaswag.jsonl"), env=ENV)
    assert r.returncode == 0, r.out[-3000:]
    # A task to download, offline: at once, naming --from.
    r = run_module("torchllm.eval.fetch", "--out", str(evals), "--tasks", "copa", env=ENV)
    assert r.returncode == 2 and "--from copa=" in r.stderr, r.out
    assert f"{UNREACHABLE} could not be reached (Connection refused)" in r.stderr, r.out


def test_the_shipped_sft_config_on_a_small_chat_file_warns(tmp_path):
    chat = write_chat(tmp_path / "chat.jsonl", [
        [{"role": "user", "content": f"question {i}?"},
         {"role": "assistant", "content": f"answer {i}."}] for i in range(41)])
    r = run_train(f"--job.dump_folder={tmp_path}", f"--data.dataset=chat:{chat}",
                  "--data.tokenizer=bytes", "--checkpoint.initial_load_path=",
                  "--training.device=cpu", "--training.stop_after_steps=1",
                  "--training.seq_len=256", "--training.mixed_precision=none",
                  "--metrics.report=false", config="train_configs/llama3_debug_sft.toml",
                  env=ENV)
    assert r.returncode == 0, r.out[-3000:]
    warnings = [ln for ln in r.out.splitlines() if "data: " in ln]
    # 41 short conversations packed into a few windows, 200 steps x 8 windows: hundreds of
    # epochs (the data and the key to change named). Validation is off in that config: nothing
    # is held out, so no word of a 0-window validation split (test_validation_off.py).
    assert any(f"chat:{chat}" in ln and "training.steps" in ln for ln in warnings), \
        r.out[-3000:]
    assert not any("0 windows" in ln for ln in warnings), r.out[-3000:]


def test_the_readme_lists_every_llama_flavor():
    from torchllm.models.llama.args import flavors

    readme = (REPO / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("| Llama 3 "))
    listed = line.split("flavors ", 1)[1].split(";", 1)[0]
    assert {f.strip() for f in listed.split("/")} == set(flavors), listed


def test_shared_is_not_needed_by_the_docs_offline_eval_commands():
    text = (REPO / "docs" / "evaluation.md").read_text()
    commands = [ln for ln in text.splitlines() if "--data-dir" in ln or "--data " in ln
                or "hellaswag_data=" in ln]
    assert commands and not any("../shared" in ln for ln in commands)
    assert "python -m torchllm.eval.fetch --out data/evals" in text
    assert SHARED.name == "shared"


def test_exported_folders_are_ignored_by_git_but_the_hf_package_is_not():
    # `python -m torchllm.hf export --out hf/NAME` (the end-of-run block's command) writes hf/.
    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0

    assert ignored("hf/debug_model/model.safetensors") and ignored("data/evals/copa")
    assert not ignored("torchllm/hf/new_module.py")
