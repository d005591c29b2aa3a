"""Data sources: one registry, one spec parser shared by the launcher and the trainer, no source
branches elsewhere; run_train.sh trains on conversations; a Hugging Face stream mixes with a
local corpus and resumes exactly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from torchllm.config import ConfigError, load_config
from torchllm.data import build_data
from torchllm.data.sources.hf import StreamWindows
from torchllm.data.dataset import parse_data
from torchllm.data.mixture import MixtureBatches
from torchllm.data.packing.chat import ChatPacking
from torchllm.data.packing.text import TextPacking
from torchllm.data.sources.registry import NAMES, PREFIXES
from torchllm.run.launch import check_config

import cli
from conftest import REPO, tiny_args, tiny_config
from builders.data import (data_args, TOK, corpus_texts, make_hf_folder,
                       resumed_equals_straight, take, write_jsonl)

SOURCES_DIR = REPO / "torchllm" / "data" / "sources"


def test_the_registry_maps_each_prefix_to_its_source_module():
    assert set(PREFIXES) == {"local", "shards", "hf"}
    assert {"embedded", "tinyshakespeare", "fineweb_edu", "fineweb_edu_100b"} <= set(NAMES)
    for cls in [*PREFIXES.values(), *NAMES.values()]:
        assert cls.__module__.startswith("torchllm.data.sources."), cls
    local = parse_data(load_config(["--data.dataset=local:x.txt"]).data)
    assert type(local.source).__name__ == "LocalFiles" and local.packing is TextPacking
    # chat: is a packing over a source, not a source: chat:PATH reads local files, chat:hf:NAME
    # streams a Hugging Face dataset; both with the chat packing.
    chat = parse_data(load_config(["--data.dataset=chat:x.jsonl"]).data)
    assert type(chat.source).__name__ == "LocalFiles" and chat.source.location == "x.jsonl"
    assert chat.packing is ChatPacking and chat.chat and chat.spec == "chat:x.jsonl"
    hub = parse_data(load_config(["--data.dataset=chat:hf:org/name"]).data)
    assert type(hub.source).__name__ == "HFStream" and hub.packing is ChatPacking


def test_no_data_source_is_named_outside_the_sources():
    """Only torchllm/data/sources/ may branch on a data source (`kind == "shards"`,
    `startswith("hf:")`): everything else asks the source object."""
    kind_names = "embedded|local|shards|hf|chat"
    pattern = re.compile(rf"""(kind\s*[!=]=\s*["']({kind_names})["'])"""
                         rf"""|(startswith\(\s*["']({kind_names}):)""")
    found = []
    for path in (REPO / "torchllm").rglob("*.py"):
        if SOURCES_DIR in path.parents:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("spec", ["chat:conv.jsonl", "chat:hf:org/name", "hf:org/name",
                                  "fineweb_edu", "local:a.txt", "shards:s", "embedded",
                                  "nope:x", "local:", "fineweb_edux"])
def test_the_launcher_checks_specs_with_the_trainers_parser(tmp_path, spec, monkeypatch):
    """check_config (run_train.sh's pre-flight) accepts exactly the specs the trainer's parser
    accepts, with the same message (the local files named exist: the pre-flight also checks
    that, test_run_safety.py)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("text")
    (tmp_path / "conv.jsonl").write_text("")
    args = [f"--data.dataset={spec}"]
    try:
        parse_data(load_config(args).data)
        trainer = None
    except ConfigError as e:
        trainer = str(e)
    try:
        check_config(args, 1)
        launcher = None
    except ConfigError as e:
        launcher = str(e)
    assert launcher == trainer
    assert (trainer is None) == (spec.split(":")[0] in {"chat", "hf", "local", "shards",
                                                        "fineweb_edu", "embedded"}
                                 and spec != "local:")
    mixed = [f"--data.sources=embedded=1,{spec}=1"]
    try:
        check_config(mixed, 1)
    except ConfigError as e:
        assert trainer is not None and f"data.sources[1] ({spec}): {trainer}" == str(e)
    else:
        assert trainer is None


def write_chat(path: Path, n: int = 40) -> Path:
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Count to {i}."},
        {"role": "assistant", "content": " ".join(str(k) for k in range(1, i + 1))}]}) + "\n"
        for i in range(1, n)))
    return path


def run_train(tmp_path, *extra, config=cli.DEBUG_CONFIG):
    """`./run_train.sh` with one process (in this process: tests/cli.py)."""
    return cli.run_train(*tiny_args(tmp_path, "--metrics.progress_bar=false"), *extra,
                         config=config)


@pytest.fixture(scope="module")
def sp512(tmp_path_factory):
    from torchllm.data.sources.embedded import embedded_documents
    from torchllm.data.tokenizer_training import train_sentencepiece

    return train_sentencepiece(embedded_documents()[:60], 512,
                               tmp_path_factory.mktemp("sp") / "sp512.model")


@pytest.mark.slow
def test_run_train_sh_trains_on_a_chat_file(tmp_path, sp512):
    chat = write_chat(tmp_path / "my_chat.jsonl")
    proc = run_train(tmp_path, f"--data.dataset=chat:{chat}", f"--data.tokenizer={sp512}",
                     "--training.steps=2")
    out = proc.out
    assert proc.returncode == 0, out[-3000:]
    assert "is not known" not in out and "step     2/2" in out
    assert "39 conversations" in out and "tokens template" in out


@pytest.mark.slow
def test_run_train_sh_trains_the_shipped_sft_config(tmp_path, sp512):
    chat = write_chat(tmp_path / "sft.jsonl")
    proc = run_train(tmp_path, f"--data.dataset=chat:{chat}", f"--data.tokenizer={sp512}",
                     "--checkpoint.initial_load_path=", "--training.steps=2",
                     "--training.local_batch_size=2",
                     config="train_configs/llama3_debug_sft.toml")
    out = proc.out
    assert proc.returncode == 0, out[-3000:]
    assert "step     2/2" in out
    assert (tmp_path / "debug_sft" / "checkpoint" / "step-2" / "COMPLETE").is_file()
    # The end-of-run block suggests chatting with a chat-trained run, not completing text.
    assert f'python -m torchllm.generate --checkpoint {tmp_path / "debug_sft"} --chat "' in out
    assert "--prompt" not in out


# -- a local corpus mixed with a streamed `datasets` source ---------------------------------

SEQ = 16


def stream_mix(tmp_path, *extra, batch=2):
    local = write_jsonl(tmp_path / "local.jsonl", corpus_texts(80, seed=5))
    folder, texts = make_hf_folder(tmp_path)
    cfg = tiny_config(tmp_path, f"--data.sources=local:{local}=0.7,hf:{folder}=0.3",
                      f"--training.seq_len={SEQ}", f"--training.local_batch_size={batch}",
                      "--data.val_documents=4", "--validation.enable", *extra)
    return cfg, texts


def test_a_stream_mixes_and_serves_its_windows_in_stream_order(tmp_path):
    cfg, texts = stream_mix(tmp_path, batch=4)
    loader, val = build_data(*data_args(cfg), TOK, 0, 1)
    ds = loader.dataset
    assert isinstance(ds, MixtureBatches) and isinstance(ds.sources[1], StreamWindows)
    batches = take(loader, 30)
    # Oracle: the stream's documents after the 4 held out, packed BOS..EOS, cut into windows.
    stream = [i for t in texts[4:] for i in TOK.encode(t, bos=True, eos=True)]
    windows = [stream[k * (SEQ + 1):(k + 1) * (SEQ + 1)] for k in range(len(stream) // (SEQ + 1))]
    which = np.array([ds.schedule[g] for g in range(30 * 4)])
    rows = [torch.cat([b["inputs"][r], b["targets"][r, -1:]]).tolist()
            for b in batches for r in range(4)]
    from_stream = [row for row, s in zip(rows, which) if s == 1]
    assert len(from_stream) == 36  # 30% of 120 windows
    assert from_stream == windows[:36]  # consecutive, in stream order, none held out
    val_text = "".join(TOK.decode(torch.cat([b["inputs"], b["targets"][:, -1:]], 1)
                                  .flatten().tolist()) for b in val)
    assert "doc0002 " in val_text and "doc0077 " in val_text  # each source's held-out part


@pytest.mark.parametrize("workers,dp", [(0, 1), (2, 2)])
def test_a_mixture_with_a_stream_resumes_exactly(tmp_path, workers, dp):
    cfg, _ = stream_mix(tmp_path, f"--data.num_workers={workers}")
    for rank in range(dp):  # 40 batches: past the end of this rank's stream, epoch 2
        resumed_equals_straight(cfg, TOK, rank, dp)


@pytest.mark.slow
def test_the_trainer_trains_and_resumes_on_a_mixture_with_a_stream(tmp_path):
    """A straight 4-step run against 2 steps + a resume from the step-2 checkpoint: the same
    losses (the resumed run reads the same batches, stream position included)."""
    from torchllm.train import Trainer

    local = write_jsonl(tmp_path / "local.jsonl", corpus_texts(80, seed=5))
    folder, _ = make_hf_folder(tmp_path)
    args = [f"--data.sources=local:{local}=0.7,hf:{folder}=0.3", "--data.val_documents=4",
            "--checkpoint.enable=true", "--checkpoint.interval=100",
            "--training.steps=6"]
    straight = Trainer(tiny_config(tmp_path, "--job.run_name=straight", *args)).train()
    half = [*args, "--job.run_name=split", "--training.stop_after_steps=3"]
    first = Trainer(tiny_config(tmp_path, *half)).train()
    resumed = Trainer(tiny_config(tmp_path, *half))
    assert resumed.step == 3
    assert first + resumed.train() == straight and all(np.isfinite(straight))


def test_a_single_file_corpus_says_its_end_is_the_validation_split(tmp_path, caplog):
    """One .txt file is one document: the note names what is held out (its end); several
    documents get no note."""
    book = tmp_path / "book.txt"
    book.write_text("".join(corpus_texts(40)))
    caplog.set_level("INFO", logger="torchllm")
    from torchllm.log import logger

    logger.addHandler(caplog.handler)
    try:
        build_data(*data_args(tiny_config(tmp_path, f"--data.dataset=local:{book}", "--validation.enable",
                               "--data.val_fraction=0.1")), TOK, 0, 1)
        notes = [r.getMessage() for r in caplog.records if "is one document" in r.getMessage()]
        assert len(set(notes)) == 1 and f"local:{book}" in notes[0] and "last 10%" in notes[0]
        caplog.clear()
        jsonl = write_jsonl(tmp_path / "docs.jsonl", corpus_texts(40))
        build_data(*data_args(tiny_config(tmp_path, f"--data.dataset=local:{jsonl}",
                               "--data.val_fraction=0.1")), TOK, 0, 1)
        assert not [r for r in caplog.records if "is one document" in r.getMessage()]
    finally:
        logger.removeHandler(caplog.handler)
