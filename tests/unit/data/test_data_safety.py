"""Data that would mix, train on nothing or fail with a bare traceback is refused with one line
naming the file, line, row or task (issue 28, round 2)."""

from __future__ import annotations

import json
import shutil

import pytest

from torchllm.config import ConfigError
from torchllm.data import build_data, build_tokenizer
from torchllm.data.prepare import main as prepare_cli
from torchllm.eval.downstream import load_tasks

from cli import run_module
from conftest import shared_path, tiny_args, tiny_config
from builders.data import data_args, TOK, corpus_texts, write_jsonl

NOT_UTF8 = "café au lait".encode("latin-1")


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def run_prepare(corpus, out, *extra):
    sp = shared_path("tokenizers", "mistral-sp32k", "tokenizer.model")
    return prepare_cli(["--dataset", f"local:{corpus}", "--tokenizer", str(sp), "--out", str(out),
                        "--shard-tokens", "300", "--val-tokens", "100", "--workers", "1", *extra])


def test_prepare_into_a_used_folder_keeps_the_old_shards_until_it_succeeds(tmp_path, capfd):
    out = tmp_path / "shards"
    old = tmp_path / "old"
    old.mkdir()
    for i, text in enumerate(corpus_texts(60)):
        (old / f"d{i:03d}.txt").write_text(text)
    assert run_prepare(old, out) == 0
    before = snapshot(out)
    assert sum(n.startswith("train_0") for n in before) > 5  # enough shards for a mix to show

    new = tmp_path / "new"
    new.mkdir()
    for i, text in enumerate(corpus_texts(30, seed=1)):
        (new / f"d{i:03d}.txt").write_text(text)
    assert run_prepare(new, out) == 2  # a used folder needs --overwrite
    err = capfd.readouterr().err
    assert str(out) in err and "--overwrite" in err and snapshot(out) == before, err

    (new / "d999.txt").write_bytes(NOT_UTF8)  # late in the file list: fails halfway
    assert run_prepare(new, out, "--overwrite") == 2
    err = capfd.readouterr().err
    assert str(new / "d999.txt") in err and "UTF-8" in err and "Traceback" not in err
    assert snapshot(out) == before  # no new shard, no temporary folder left behind

    (new / "d999.txt").unlink()
    assert run_prepare(new, out, "--overwrite") == 0
    index = json.loads((out / "index.json").read_text())
    listed = {s["file"] for split in index["splits"].values() for s in split["shards"]}
    assert {n for n in snapshot(out) if n.endswith(".bin")} == listed  # no stale shard left
    assert index["dataset"] == f"local:{new}"


def test_training_refuses_a_shard_not_listed_in_the_index(tmp_path):
    out = tmp_path / "shards"
    assert run_prepare(write_jsonl(tmp_path / "c.jsonl", corpus_texts()), out) == 0
    (out / "train_000099.bin").write_bytes((out / "train_000000.bin").read_bytes())
    proc = run_module("torchllm.train", *tiny_args(tmp_path, f"--data.dataset=shards:{out}"))
    assert proc.returncode == 2, proc.out[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    # one line naming the shard and the index that does not list it
    assert len(errors) == 1 and str(out / "train_000099.bin") in errors[0] \
        and str(out / "index.json") in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.out


def test_sft_data_without_an_assistant_turn_stops_at_start(tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": f"hi {i}"}]})
        + "\n" for i in range(20)))
    gpt2 = shared_path("tokenizers", "gpt2", "gpt2.tiktoken")
    proc = run_module("torchllm.train", *tiny_args(
        tmp_path, f"--data.dataset=chat:{chat}", f"--data.tokenizer={gpt2}"))
    assert proc.returncode == 2, proc.out[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    # one line naming the data, how many conversations have a reply, and what to check
    assert len(errors) == 1 and f"chat:{chat}" in errors[0], proc.stderr[-2000:]
    assert "0 of 20" in errors[0] and "'role'" in errors[0] and "step" not in proc.stderr


def error_of(tmp_path, dataset, tok=TOK, *extra):
    with pytest.raises(ConfigError) as e:
        build_data(*data_args(tiny_config(tmp_path, f"--data.dataset={dataset}", *extra)), tok, 0, 1)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_unreadable_local_files_are_named(tmp_path):
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, text in enumerate(corpus_texts(5)):
        (folder / f"{i}.txt").write_text(text)
    (folder / "4.txt").write_bytes(b"fine\n" + NOT_UTF8)
    said = error_of(tmp_path, f"local:{folder}")
    assert all(w in said for w in (str(folder / "4.txt"), "UTF-8", "line 2", "byte 3")), said

    rows = tmp_path / "rows.jsonl"
    lines = [json.dumps({"text": t}) for t in corpus_texts(300)]
    lines[199] = '{"text": broken'
    rows.write_text("\n".join(lines) + "\n")
    said = error_of(tmp_path, f"local:{rows}")
    assert all(w in said for w in (str(rows), "line 200", "JSON")), said


def test_bad_chat_files_name_the_file_line_and_value(tmp_path):
    gpt2 = shared_path("tokenizers", "gpt2", "gpt2.tiktoken")
    chat = tmp_path / "chat.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "hello"}]})
    chat.write_text("\n".join([good] * 199 + ["{not json"] + [good] * 5) + "\n")
    cfg = tiny_config(tmp_path, f"--data.dataset=chat:{chat}", f"--data.tokenizer={gpt2}")
    tok = build_tokenizer(cfg.data, tmp_path)
    extra = f"--data.tokenizer={gpt2}"
    said = error_of(tmp_path, f"chat:{chat}", tok, extra)
    assert all(w in said for w in (str(chat), "line 200", "JSON")), said

    chat.write_text(json.dumps({"messages": "hello"}) + "\n")
    said = error_of(tmp_path, f"chat:{chat}", tok, extra)
    assert all(w in said for w in ("row 0", "'messages'", "{'role', 'content'}", "'hello'")), said
    chat.write_text(json.dumps({"messages": ["hello"]}) + "\n")
    said = error_of(tmp_path, f"chat:{chat}", tok, extra)
    assert all(w in said for w in ("row 0", "message 0", "'role'")), said
    chat.write_bytes(good.encode() + b"\n" + b'{"messages": "' + NOT_UTF8 + b'"}\n')
    said = error_of(tmp_path, f"chat:{chat}", tok, extra)
    assert all(w in said for w in (f"chat:{chat}", "UTF-8", "line 2")), said


def test_a_damaged_task_copy_names_the_task_and_path(tmp_path):
    copa = shared_path("data", "evals", "copa")
    damaged = tmp_path / "evals" / "copa"
    shutil.copytree(copa, damaged)
    arrow = next(damaged.glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:500])
    with pytest.raises(ValueError) as e:
        load_tasks(["copa"], 0, str(tmp_path / "evals"))
    assert all(w in str(e.value) for w in ("copa", str(damaged), "ArrowInvalid")), str(e.value)
    shutil.rmtree(damaged)
    (tmp_path / "evals" / "copa.jsonl").write_text('{"premise": "x"}\n{bad\n')
    with pytest.raises(ValueError) as e:
        load_tasks(["copa"], 0, str(tmp_path / "evals"))
    assert "copa.jsonl" in str(e.value) and "line 2" in str(e.value), str(e.value)
    (tmp_path / "evals" / "copa.jsonl").write_text('{"premise": "x"}\n')
    with pytest.raises(ValueError) as e:
        load_tasks(["copa"], 0, str(tmp_path / "evals"))
    assert all(w in str(e.value) for w in ("copa", "row 0", "'question'")), str(e.value)
