"""`python -m torchllm.eval.fetch` replaces the copy it fetched, whatever form the older one had
(issue 61, item 12): the evals read `<task>/` before `<task>.jsonl`, so a new file beside an
older folder (or a new folder beside an older file) would leave the evals reading the old data.
A fetch that fails midway keeps the older copy."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

from torchllm.eval.tasks import load_items

from cli import run_module

ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def copa_rows(word: str, n: int) -> list[dict]:
    return [{"premise": f"{word} {i}.", "choice1": "A.", "choice2": "B.", "question": "effect",
             "label": i % 2} for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def premises(evals: Path) -> list[str]:
    """What an eval reads for copa from `evals` (its premise, the prompt's start)."""
    return [item.contexts[0] for item in load_items("copa", str(evals), hub=False)]


def test_a_file_fetched_over_an_older_folder_is_what_the_evals_read(tmp_path):
    evals = tmp_path / "evals"
    datasets.Dataset.from_list(copa_rows("Old", 3)).save_to_disk(str(evals / "copa"))
    assert premises(evals)[0].startswith("Old 0")
    mine = write_jsonl(tmp_path / "mine.jsonl", copa_rows("Mine", 5))
    r = run_module("torchllm.eval.fetch", "--out", str(evals), "--tasks", "copa", "--from",
                   f"copa={mine}", env=ENV)
    assert r.returncode == 0, r.out
    assert not (evals / "copa").exists() and (evals / "copa.jsonl").is_file()
    got = premises(evals)
    assert len(got) == 5 and got[0].startswith("Mine 0"), got
    assert sorted(p.name for p in evals.iterdir()) == ["copa.jsonl"]  # no staging left


def test_a_hub_fetch_over_an_older_file_replaces_it_and_a_failed_one_keeps_it(
        tmp_path, monkeypatch):
    evals = tmp_path / "evals"
    evals.mkdir()
    write_jsonl(evals / "copa.jsonl", copa_rows("Old", 3))
    # The Hub, as datasets answers it (this process: run_module calls main in-process).
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda *a, **k: datasets.Dataset.from_list(copa_rows("Hub", 4)))
    monkeypatch.setattr("torchllm.hub.prepare_hub", lambda: False)
    real_save = datasets.Dataset.save_to_disk

    def fails_midway(self, path, *a, **k):  # a disk that fills while the copy is written
        real_save(self, path, *a, **k)
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", fails_midway)
    r = run_module("torchllm.eval.fetch", "--out", str(evals), "--tasks", "copa", "--force",
                   env=ENV)
    assert r.returncode == 2 and "Traceback" not in r.out, r.out
    assert "No space left" in r.stderr, r.out
    assert premises(evals)[0].startswith("Old 0")  # the older copy, whole
    assert sorted(p.name for p in evals.iterdir()) == ["copa.jsonl"]
    monkeypatch.setattr(datasets.Dataset, "save_to_disk", real_save)
    r = run_module("torchllm.eval.fetch", "--out", str(evals), "--tasks", "copa", "--force",
                   env=ENV)
    assert r.returncode == 0, r.out
    assert (evals / "copa").is_dir() and not (evals / "copa.jsonl").exists()
    got = premises(evals)
    assert len(got) == 4 and got[0].startswith("Hub 0"), got
