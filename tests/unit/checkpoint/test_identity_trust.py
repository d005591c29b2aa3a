"""One identity record per step (issue 52, items 4-6): the run that wrote it, what its data was,
which tokenizer made its ids. Tried as the issue's attacker did, through the command a user types:
another run's checkpoint folder reached by a file:// URL or a shared object-store prefix is never
resumed, written into or pruned; a resume over an edited corpus or chat file (same length
included) is refused; shards made with one tokenizer refuse another of the same size."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from torchllm.checkpoint.layout import complete_steps
from torchllm.checkpoint.step import read_marker
from torchllm.data.prepare import main as prepare_cli
from torchllm.data.sources.embedded import embedded_documents
from torchllm.train import main

import cli
from conftest import tiny_args
from messages import refused
from s3_server import s3, s3_endpoint  # noqa: F401 - fixtures

CKPT = ("--checkpoint.enable", "--checkpoint.interval=2", "--data.tokenizer=bytes",
        "--metrics.progress_bar=false")


def run_train(root: Path, *extra: str) -> cli.Ran:
    """./run_train.sh (NGPU=1, in this process: tests/cli.py) on the tiny config."""
    return cli.run_train(*tiny_args(root, *CKPT, *extra))


def snapshot(folder) -> dict[str, bytes]:
    """Every file under a local folder, by relative path (what must not change)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def victim(tmp_path_factory) -> dict:
    """A finished 4-step run ("victim", steps 2 and 4) on a local .jsonl corpus."""
    root = tmp_path_factory.mktemp("victim")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in embedded_documents()[:40]))
    data = f"--data.dataset=local:{corpus}"
    r = run_train(root, "--job.run_name=victim", data, "--checkpoint.keep_latest_k=2")
    assert r.returncode == 0, r.out[-3000:]
    folder = root / "victim" / "checkpoint"
    assert complete_steps(folder) == [2, 4]
    return {"root": root, "folder": folder, "corpus": corpus, "data": data}


# --- 4. another run's checkpoints ---------------------------------------------------------

@pytest.mark.slow
def test_a_file_url_to_another_runs_folder_is_refused_before_anything_runs(victim, tmp_path):
    before = snapshot(victim["folder"])
    url = f"file://{victim['folder']}"
    line = refused(run_train(tmp_path, "--job.run_name=thief", victim["data"],
                             "--training.steps=8", f"--checkpoint.folder={url}"),
                   "checkpoint.folder", url)
    # the launcher's own config check (not a rank's refusal of the steps it found there)
    assert line.startswith("run_train: config error:"), line
    assert "checkpoint.initial_load_path" in line  # the key that reads another run's step
    assert snapshot(victim["folder"]) == before  # nothing resumed, written or pruned
    assert not (tmp_path / "thief" / "checkpoint").exists()


@pytest.mark.slow
def test_a_shared_bucket_prefix_is_never_resumed_written_or_pruned_by_another_run(
        s3, tmp_path):
    """The victim trains into s3://.../ckpt; a thief naming the same prefix is refused (one
    line naming the prefix, the victim's run id and checkpoint.initial_load_path), with and
    without --job.overwrite; the victim's objects are untouched and it resumes as before."""
    import s3fs

    prefix = f"{s3}/ckpt"
    common = (f"--checkpoint.folder={prefix}", "--checkpoint.keep_latest_k=1")
    assert main(tiny_args(tmp_path / "a", *CKPT, "--job.run_name=victim", *common)) == 0
    fs = s3fs.S3FileSystem()
    objects = lambda: {k: fs.cat_file(k) for k in fs.find(prefix.split("://")[1])}  # noqa: E731
    before = objects()
    assert complete_steps(prefix) == [4]
    owner = read_marker(f"{prefix}/step-4")["run_id"]
    assert owner == (tmp_path / "a" / "victim" / "run_id").read_text().strip()
    for extra in ((), ("--job.overwrite",)):
        line = refused(run_train(tmp_path / "b", "--job.run_name=thief", "--training.steps=8",
                                 *common, *extra),
                       prefix, owner, "checkpoint.initial_load_path")
        assert objects() == before, (extra, line)
    # The victim itself still resumes from its own step.
    assert main(tiny_args(tmp_path / "a", *CKPT, "--job.run_name=victim", *common,
                          "--training.steps=6")) == 0
    assert complete_steps(prefix) == [6]


def test_steps_of_another_run_copied_into_a_runs_own_folder_are_refused_in_process(
        victim, tmp_path):
    """The same rule without a bucket, at the Checkpointer: a run folder with its own id whose
    checkpoint folder holds the victim's steps refuses to resume, save or prune."""
    from torchllm.config import ConfigError
    from torchllm.train import Trainer

    from conftest import tiny_config

    run = tmp_path / "thief"
    shutil.copytree(victim["folder"], run / "checkpoint")
    (run / "run_id").write_text("thief0000\n")
    before = snapshot(run / "checkpoint")
    with pytest.raises(ConfigError, match=r"another run's checkpoints .* written by run "):
        Trainer(tiny_config(tmp_path, *CKPT, "--job.run_name=thief", victim["data"],
                            "--training.steps=8"))
    assert snapshot(run / "checkpoint") == before


# --- 5. another data set ------------------------------------------------------------------

@pytest.mark.slow
def test_a_same_length_edit_of_the_corpus_is_refused_at_resume(victim, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(victim["root"] / "victim", run / "victim")
    text = victim["corpus"].read_bytes()
    at = len(text) // 2
    edited = text[:at] + (b"X" if text[at:at + 1] != b"X" else b"Y") + text[at + 1:]
    victim["corpus"].write_bytes(edited)
    try:
        refused(run_train(run, "--job.run_name=victim", victim["data"], "--training.steps=6"),
                f"local:{victim['corpus']}", "checkpoint.on_data_change")
    finally:
        victim["corpus"].write_bytes(text)
    assert complete_steps(run / "victim" / "checkpoint") == [2, 4]


@pytest.mark.slow
def test_a_changed_chat_file_is_refused_at_resume(tmp_path, capsys):
    chat = tmp_path / "chat.jsonl"
    convs = [[{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]
             for w in ["apple", "banana", "cherry", "dates", "elder", "figs"] * 3]
    chat.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    args = lambda *more: tiny_args(tmp_path, *CKPT, "--job.run_name=sft",  # noqa: E731
                                   f"--data.dataset=chat:{chat}", "--data.val_fraction=0",
                                   "--training.steps=2", *more)
    assert main(args()) == 0
    chat.write_text(chat.read_text().replace("cherry", "cheese"))  # same length
    capsys.readouterr()
    assert main(args("--training.steps=4")) == 2
    said = capsys.readouterr()
    lines = [x for x in (said.out + said.err).splitlines() if f"chat:{chat}" in x
             and "checkpoint.on_data_change" in x]
    assert lines, said.err[-3000:]
    assert complete_steps(tmp_path / "sft" / "checkpoint") == [2]


# --- 6. another tokenizer -----------------------------------------------------------------

@pytest.mark.slow
def test_shards_of_one_tokenizer_refuse_another_of_the_same_size(tmp_path):
    from torchllm.data.tokenizer_training import train_sentencepiece

    docs = embedded_documents()
    a = train_sentencepiece(docs[::2], 512, tmp_path / "a.model")
    b = train_sentencepiece(docs[1::2], 512, tmp_path / "b.model")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(docs[:30]))
    shards = tmp_path / "shards"
    assert prepare_cli(["--dataset", f"local:{corpus}", "--tokenizer", str(a), "--out",
                        str(shards), "--val-tokens", "500"]) == 0
    index = json.loads((shards / "index.json").read_text())
    assert index["tokenizer_sha256"] == hashlib.sha256(Path(a).read_bytes()).hexdigest()
    line = refused(run_train(tmp_path, "--job.run_name=other_tok", f"--data.dataset=shards:{shards}",
                             f"--data.tokenizer={b}", "--training.steps=2"),
                   str(shards / "index.json"), "data.tokenizer", str(b))
    assert str(a) in line
