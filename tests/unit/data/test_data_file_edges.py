"""Data files that are not what they seem (issue 61, item 15), through ./run_train.sh: a
garbage tokenizer_config.json is one line naming it; a FIFO (or another non-regular file) in a
local: folder is named as not a regular file and never opened (a reader would block on it); a
link in a local: folder that leads outside the folder is refused, naming the link."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path

import pytest

from torchllm.data.sources.local import local_files

from cli import run_train
from conftest import tiny_args
from messages import refused

FAST = ("--training.steps=1", "--checkpoint.enable=false", "--metrics.progress_bar=false")


def word_tokenizer(folder: Path) -> Path:
    """A WordLevel tokenizer.json (`tokenizers`) with <s> and </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<s>", "</s>", "<unk>", *"the quick brown fox jumps over a lazy dog".split()]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(words[:2])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


CONFIGS = {"not_json": "{bos_token: <s>,", "a_list": json.dumps(["<s>", "</s>"]),
           "not_utf8": b"\xff\xfe{}", "bos_a_number": json.dumps({"bos_token": 7})}


@pytest.mark.parametrize("garbage", list(CONFIGS))
def test_a_garbage_tokenizer_config_is_one_line_naming_it(tmp_path, garbage):
    tok = word_tokenizer(tmp_path / "tok")
    cfg = tok.with_name("tokenizer_config.json")
    text = CONFIGS[garbage]
    cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over a lazy dog\n" * 200)
    ran = run_train(*tiny_args(tmp_path, f"--data.dataset=local:{corpus}",
                               f"--data.tokenizer={tok}", *FAST))
    refused(ran, cfg)


class FifoWatch:
    """Whether anyone opened `path` (a FIFO) to read it: a writer end is tried every 50 ms (it
    opens only while a reader is waiting), then closed at once, so a reader that opens the FIFO
    reads an empty file instead of blocking the test forever."""

    def __init__(self, path: Path):
        self.path, self.opened, self.stop = path, False, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stop.is_set():
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                if e.errno not in (errno.ENXIO, errno.ENOENT):
                    raise
                time.sleep(0.05)
                continue
            self.opened = True
            os.close(fd)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def test_a_fifo_in_a_local_folder_is_named_and_never_opened(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("the quick brown fox jumps over a lazy dog\n" * 200)
    fifo = folder / "pipe.txt"
    os.mkfifo(fifo)
    watch = FifoWatch(fifo)
    try:
        ran = run_train(*tiny_args(tmp_path, f"--data.dataset=local:{folder}",
                                   "--data.tokenizer=bytes", *FAST))
    finally:
        watch.close()
    line = refused(ran, fifo, "regular file")
    assert "no such file" not in line, line
    assert not watch.opened, "the FIFO was opened to be read"


def test_a_link_leading_out_of_a_local_folder_is_refused_naming_it(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("the quick brown fox jumps over a lazy dog\n" * 200)
    (tmp_path / "private.txt").write_text("not part of the corpus\n" * 200)
    inside = folder / "again.txt"
    inside.symlink_to("a.txt")  # inside the folder: read as before
    assert local_files(str(folder)) == [str(folder / "a.txt"), str(inside)]
    link = folder / "sub" / "leak.txt"
    link.parent.mkdir()
    link.symlink_to(tmp_path / "private.txt")
    ran = run_train(*tiny_args(tmp_path, f"--data.dataset=local:{folder}",
                               "--data.tokenizer=bytes", *FAST))
    refused(ran, link, tmp_path / "private.txt")
    (folder / "sub" / "leak.txt").unlink()
    (folder / "out").symlink_to(tmp_path, target_is_directory=True)  # a folder link, too
    refused(run_train(*tiny_args(tmp_path, f"--data.dataset=local:{folder}",
                                 "--data.tokenizer=bytes", *FAST)), folder / "out")
