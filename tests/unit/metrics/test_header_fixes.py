"""The run header says what the run does, no more: validation only when it is on, mixtures and
conversations by source (sizes, not a dataclass repr), counts in the singular, no description
of data the command line replaced, no leftover Hugging Face keys; one "ran out" line per source."""

import logging

import pytest

from torchllm.config import load_config
from torchllm.data import build_data
from torchllm.data.chat.tokens import ChatTokenizer
from torchllm.metrics.header import config_changes, data_summary

from conftest import tiny_config
from builders.data import data_args, TOK, corpus_texts, write_jsonl
from builders.chat import write_chat


def summary(cfg, tok=TOK):
    train, val = build_data(*data_args(cfg), tok, 0, 1)
    return data_summary(train.dataset, val.dataset, 4, cfg.training.steps,
                        validation=cfg.validation.enable)


def test_validation_is_named_only_when_it_is_on(tmp_path):
    text = write_jsonl(tmp_path / "t.jsonl", corpus_texts())
    off = summary(tiny_config(tmp_path, f"--data.dataset=local:{text}"))
    on = summary(tiny_config(tmp_path, f"--data.dataset=local:{text}", "--validation.enable"))
    # off: nothing held out, said so (the split is named only when validation reads it)
    assert off.endswith(" | validation off: nothing held out (data.val_fraction unused)"), off
    assert " | validation " in on and "windows)" in on and "validation off" not in on


def test_mixture_and_chat_sources_are_summarized_per_source(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("a single document " * 40)
    text = write_jsonl(tmp_path / "t.jsonl", corpus_texts())
    chat = write_chat(tmp_path / "c.jsonl", [
        [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"reply {i}"}]
        for i in range(40)])
    spec = f"local:{one}=0.3,local:{text}=0.5,chat:{chat}=0.2"
    cfg = tiny_config(tmp_path, f"--data.sources={spec}", "--training.seq_len=24")
    changed = " ".join(config_changes(cfg)["data"])
    assert "DataSource(" not in changed and "..." not in changed
    assert f"sources=[local:{one} x0.3, local:{text} x0.5, chat:{chat} x0.2]" in changed
    line = summary(cfg, ChatTokenizer(TOK))
    assert "streamed" not in line and "DataSource" not in line
    parts = line.split(" | ")
    assert parts[0].startswith(f"4 steps x 4 windows; local:{one} x0.3: train 1 document, ")
    assert parts[1].startswith(f"local:{text} x0.5: train ") and " documents, " in parts[1]
    assert parts[2].startswith(f"chat:{chat} x0.2: train ") and " windows per epoch" in parts[2]
    # A single conversation file (no weights): its windows, not "size unknown".
    alone = summary(tiny_config(tmp_path, f"--data.dataset=chat:{chat}",
                                "--training.seq_len=24"), ChatTokenizer(TOK))
    assert "streamed" not in alone and f"chat:{chat}: train " in alone


def test_a_replaced_dataset_drops_the_files_description(tmp_path):
    toml = tmp_path / "sft.toml"
    toml.write_text('[job]\ndescription = "SFT on SmolTalk"\n\n[data]\n'
                    'dataset = "chat:hf:HuggingFaceTB/smoltalk"\nhf_subset = "everyday"\n')
    assert load_config([f"--job.config_file={toml}"]).job.description == "SFT on SmolTalk"
    cfg = load_config([f"--job.config_file={toml}", "--data.dataset=chat:local:mine.jsonl"])
    assert cfg.job.description == ""
    assert "hf_subset" not in " ".join(config_changes(cfg).get("data", []))  # not HF any more
    both = load_config([f"--job.config_file={toml}", "--data.dataset=embedded",
                        "--job.description=mine"])
    assert both.job.description == "mine"
    hf = load_config([f"--job.config_file={toml}"])
    assert "hf_subset='everyday'" in config_changes(hf)["data"]


@pytest.mark.slow
def test_a_source_that_runs_out_every_step_says_so_once(tmp_path, caplog):
    """10 steps over a one-window source: one 'ran out' line for it, then a count at the end."""
    from torchllm.train import Trainer

    one = tmp_path / "one.txt"
    one.write_text("tiny text " * 6)  # a few dozen tokens: one window of 32
    text = write_jsonl(tmp_path / "t.jsonl", corpus_texts())
    cfg = tiny_config(tmp_path, f"--data.sources=local:{text}=0.5,local:{one}=0.5",
                      "--training.steps=10", "--metrics.log_freq=100", "--data.val_fraction=0")
    logger = logging.getLogger("torchllm")
    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="torchllm"):
            trainer = Trainer(cfg)
            trainer.train()
    finally:
        logger.propagate = False
    lines = [r.getMessage() for r in caplog.records if "data source 1" in r.getMessage()]
    ran_out = [m for m in lines if "ran out after epoch" in m]
    assert len(ran_out) == 1, lines
    count = [m for m in lines if "times in this launch" in m]
    assert len(count) == 1 and " ran out " in count[0]
    n = int(count[0].split(" ran out ")[1].split()[0])
    assert n >= 9  # 2 windows of this source per step: a new epoch each time


def test_a_held_out_split_of_no_windows_is_warned_of_only_when_it_is_held_out(tmp_path):
    """data_warnings takes the [data] and [validation] sections and whether the training data
    holds a split out: a split of 0 windows is named (with data.val_fraction, the key to
    raise) only then, and not for a validation that reads a split of its own."""
    from types import SimpleNamespace

    from torchllm.metrics.header import data_warnings

    cfg = tiny_config(tmp_path, "--validation.enable", "--data.val_fraction=0.001")
    train = SimpleNamespace()  # no per-source sizes: only the validation split is in question
    (warning,) = data_warnings(cfg.data, cfg.validation, True, train, [], 4, 10)
    assert "0 windows" in warning and "data.val_fraction = 0.001" in warning, warning
    assert data_warnings(cfg.data, cfg.validation, False, train, [], 4, 10) == []
    assert data_warnings(cfg.data, cfg.validation, True, train, [object()], 4, 10) == []
