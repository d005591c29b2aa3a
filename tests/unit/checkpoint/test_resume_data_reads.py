"""A resume whose settings choose other tokens to train or validate is a data change (issue 61,
item 10): data.text_column (other text), data.val_fraction (another holdout), a new
validation.dataset (the held-out split trains). Each is refused like any other data change
(checkpoint.on_data_change = 'error': exit 2, one line naming the key and both values), through
./run_train.sh; a record written before these settings were recorded is not compared."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from torchllm.data.fingerprint import changes

from cli import run_train
from conftest import shared_path, tiny_args
from messages import refused

CKPT = ("--checkpoint.enable", "--job.run_name=run", "--checkpoint.interval=2",
        "--data.tokenizer=bytes", "--metrics.progress_bar=false")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """rows.jsonl (each row's text in `text`, reversed in `body`), other.txt, and a run that
    trained 2 steps on rows.jsonl's `text` holding out 5% (checkpoint step-2)."""
    root = tmp_path_factory.mktemp("reads")
    text = shared_path("data", "tinyshakespeare.txt").read_text()[:60_000]
    rows = [p for p in text.split("\n\n") if p.strip()]
    with open(root / "rows.jsonl", "w") as f:
        for p in rows:
            f.write(json.dumps({"text": p, "body": p[::-1]}) + "\n")
    (root / "other.txt").write_text(text[::-1])
    data = f"--data.dataset=local:{root / 'rows.jsonl'}"
    ran = run_train(*tiny_args(root / "dump", data, *CKPT, "--training.steps=2"))
    assert ran.returncode == 0, ran.out[-3000:]
    return {"root": root, "data": data}


CHANGED = {
    "text_column": ("--data.text_column=body", ("data.text_column", "'text'", "'body'")),
    "val_fraction": ("--data.val_fraction=0.5", ("data.val_fraction", "0.05", "0.5")),
    "validation_dataset": ("--validation.dataset=local:{root}/other.txt",
                           ("validation.dataset", "''", "other.txt")),
}


@pytest.mark.slow
@pytest.mark.parametrize("change", list(CHANGED))
def test_a_resume_reading_other_tokens_is_refused_naming_the_key(trained, tmp_path, change):
    dump = tmp_path / "dump"
    shutil.copytree(trained["root"] / "dump", dump)
    override, named = CHANGED[change]
    ran = run_train(*tiny_args(dump, trained["data"], *CKPT, "--training.steps=3",
                               override.format(root=trained["root"])))
    line = refused(ran, *named)
    assert "checkpoint.on_data_change" in line and "step-2" in line, line
    assert not (dump / "run" / "checkpoint" / "step-3").exists()  # nothing trained on


@pytest.mark.slow
def test_the_same_reads_resume(trained, tmp_path):
    """validation.dataset = data.dataset is the held-out split, as before: not a change."""
    dump = tmp_path / "dump"
    shutil.copytree(trained["root"] / "dump", dump)
    ran = run_train(*tiny_args(dump, trained["data"], *CKPT, "--training.steps=3",
                               trained["data"].replace("data.dataset", "validation.dataset")))
    assert ran.returncode == 0, ran.out[-3000:]
    assert (dump / "run" / "checkpoint" / "step-3").is_dir()


def test_a_record_from_before_reads_is_not_compared():
    """An older marker has no `reads`: its resume goes on as before (not refused)."""
    old = {"sources": [["embedded", 1.0]], "mixture": False, "content": ["texts:blake2b:ab"],
           "seq_len": 32, "seed": 42, "shuffle_windows": True, "tokenizer_sha256": "x"}
    now = {**old, "reads": {"data.text_column": "body", "data.val_fraction": 0.5}}
    assert changes(old, now) == []
    saved = {**old, "reads": {"data.text_column": "text", "data.val_fraction": 0.5}}
    assert changes(saved, now) == ["data.text_column 'text' -> 'body'"]
