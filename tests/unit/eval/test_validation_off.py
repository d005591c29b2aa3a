"""With validation off nothing is held out of training (issue 63, item 6), through the command a
user types:

    ./run_train.sh --validation.enable=false --data.dataset=local:novel.txt ...
    ./run_train.sh --validation.enable=false --data.dataset=chat:chats.jsonl ...

A corpus (embedded, local:) and conversations (chat:) train on every window: data.val_fraction
applies only when validation reads the split it holds out, and the header says so.
"""

from __future__ import annotations

import json
import re

import pytest

from cli import run_module, run_train
from builders.data import SHAKESPEARE

pytestmark = pytest.mark.slow

ARGS = ["--training.device=cpu", "--model.flavor=debug", "--training.seq_len=32",
        "--training.local_batch_size=4", "--data.tokenizer=bytes", "--metrics.log_freq=1",
        "--lr_scheduler.warmup_steps=1", "--training.mixed_precision=none",
        "--metrics.progress_bar=false", "--job.print_config=false", "--metrics.report=false",
        "--training.steps=1", "--validation.enable=false"]


def flat(out: str) -> str:
    """The console with the header's wrapped lines joined."""
    return " ".join(re.sub(r"^\[rank0\]:", "", line).strip() for line in out.split("\n"))


def train(tmp, *extra: str) -> str:
    r = run_train(f"--job.dump_folder={tmp}", *ARGS, *extra)
    assert r.returncode == 0, r.out[-4000:]
    return flat(r.out)


def test_a_corpus_trains_on_all_of_its_text_with_validation_off(tmp_path):
    novel = tmp_path / "novel.txt"
    novel.write_text(SHAKESPEARE.read_text()[:20_000])
    out = train(tmp_path, "--job.run_name=off", f"--data.dataset=local:{novel}",
                "--data.val_fraction=0.2", "--checkpoint.enable", "--checkpoint.interval=1000")
    n = len(novel.read_bytes()) + 2  # bytes tokenizer: BOS + every byte + EOS
    assert f"local:{novel}: train 1 document, {n:,} tokens" in out, out[-3000:]
    assert "validation is its last" not in out
    # the header says that nothing is held out, data.val_fraction unused
    assert "validation off: nothing held out (data.val_fraction unused)" in out, out[-3000:]
    # eval.loss without --data scores the split a validating run would hold out: this run
    # trained on it, and the command says so (and what to pass instead)
    proc = run_module("torchllm.eval.loss", "--checkpoint", str(tmp_path / "off"))
    assert proc.returncode == 0, proc.out[-3000:]
    assert re.search(r"trained on.*validation off.*--data", proc.out), proc.out[-3000:]


def test_conversations_train_on_every_window_with_validation_off(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Count to {i}."},
        {"role": "assistant", "content": " ".join(str(k) for k in range(1, i + 1))}]}) + "\n"
        for i in range(1, 40)))
    windows = []
    for fraction in ("0", "0.25"):
        out = train(tmp_path, f"--job.run_name=chat{fraction}", f"--data.dataset=chat:{chats}",
                    f"--data.val_fraction={fraction}")
        m = re.search(r"([\d,]+) windows? per epoch", out)
        assert m, out[-3000:]
        windows.append(int(m.group(1).replace(",", "")))
    # data.val_fraction = 0.25 holds nothing out when nothing validates: the same windows train
    assert windows[0] == windows[1] > 0, windows
