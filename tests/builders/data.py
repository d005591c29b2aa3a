"""Shared test builders (tests/builders/data.py): imported by the test modules that use them."""

from __future__ import annotations

from pathlib import Path
import json
import re

import numpy as np
import torch

from torchllm.data import Batching, build_data, build_tokenizer

from conftest import REPO


# Short documents (lines of the embedded corpus): the 16-token windows hold several of them.
SHORT_DOCS = "--data.dataset=local:{tmp}/short_docs.jsonl"


DOCS = ("--model.attn_mask_type=block_causal", "--model.restart_positions_per_document=true",
        SHORT_DOCS)


def write_short_docs(path) -> None:
    from torchllm.data.sources.embedded import embedded_documents

    lines = [line.strip() for doc in embedded_documents() for line in doc.split("\n")]
    with open(path, "w") as f:
        for line in lines:
            if 10 <= len(line) <= 30:
                f.write(json.dumps({"text": line}) + "\n")


def data_args(cfg) -> tuple:
    """build_data's config arguments of a JobConfig: its [data] and [validation] sections and
    the windows its [training], [job] and [model] sections make (Batching)."""
    return cfg.data, cfg.validation, Batching.of(cfg.training, cfg.job, cfg.model)


def validation_args(cfg) -> tuple:
    """eval.in_training.validation_loader's config arguments of a JobConfig: [data],
    [validation], [training] and its Batching."""
    return cfg.data, cfg.validation, cfg.training, Batching.of(cfg.training, cfg.job, cfg.model)


def fill(args, tmp):
    return [a.format(tmp=tmp) for a in args]


class ByteTokenizer:
    """UTF-8 bytes + 3; BOS 1, EOS 2: trivially checkable ids for loader tests."""

    vocab_size, bos_id, eos_id = 259, 1, 2

    def encode(self, text, bos=False, eos=False):
        return [1] * bos + [b + 3 for b in text.encode()] + [2] * eos

    def decode(self, ids):
        return bytes(i - 3 for i in ids if i > 2).decode(errors="replace")


TOK = ByteTokenizer()


def corpus_texts(n=120, seed=0):
    rng = np.random.default_rng(seed)
    letters = list("abcdefghijklmnopqrstuvwxyz ")  # random text: no two windows are equal
    return [f"doc{i:04d} " + "".join(rng.choice(letters, rng.integers(5, 150))) for i in range(n)]


def write_jsonl(path, texts, column="text"):
    path.write_text("".join(json.dumps({column: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def take(loader, k):
    it = iter(loader)
    return [next(it) for _ in range(k)]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and {"inputs", "targets", "positions"} <= x.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


def resumed_equals_straight(cfg, tokenizer, rank: int, dp: int, stop: int = 7, more: int = 40):
    """Oracle for exact resume: a straight loader's batches `stop`..`stop + more` against a new
    loader built from its state after `stop` batches (pickled, as a checkpoint holds it).
    Returns those batches for further checks."""
    import pickle

    from torchllm.data import build_data

    loader, _ = build_data(*data_args(cfg), tokenizer, rank, dp)
    it = iter(loader)
    for _ in range(stop):
        next(it)
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    after = [next(it) for _ in range(more)]
    resumed, _ = build_data(*data_args(cfg), tokenizer, rank, dp)
    resumed.load_state_dict(state)
    assert_batches_equal(take(resumed, more), after)
    return after


def make_hf_folder(tmp_path, n_files=4, per_file=8):
    folder = tmp_path / "hub_like"
    folder.mkdir()
    texts = corpus_texts(n_files * per_file, seed=1)
    for f in range(n_files):
        write_jsonl(folder / f"part-{f}.jsonl", texts[f * per_file : (f + 1) * per_file])
    return folder, texts


SEQ = 32


ARGS = ["--training.device=cpu", "--model.flavor=debug", f"--training.seq_len={SEQ}",
        "--training.local_batch_size=4", "--data.tokenizer=bytes", "--metrics.log_freq=1",
        "--lr_scheduler.warmup_steps=1", "--training.mixed_precision=none",
        "--metrics.progress_bar=false", "--job.print_config=false", "--metrics.report=false",
        "--validation.enable", "--validation.freq=2", "--checkpoint.enable",
        "--checkpoint.interval=1000"]


SHAKESPEARE = REPO / "torchllm" / "data" / "assets" / "tinyshakespeare.txt"


def texts(tmp: Path) -> tuple[Path, Path]:
    """A one-document novel (pre-training) and a longer text of its own (validation)."""
    words = SHAKESPEARE.read_text()
    novel, val = tmp / "novel.txt", tmp / "val.txt"
    novel.write_text(words[:30_000])
    val.write_text(words[30_000:130_000])
    return novel, val


def header_validation(out: str) -> str:
    """The run header's validation part, its wrapped lines joined."""
    lines = out.split("\n")
    start = next(i for i, line in enumerate(lines) if "  data      " in line)
    block = []
    for line in lines[start:]:
        text = re.sub(r"^\[rank0\]:", "", line)
        if block and not text.startswith("            "):
            break
        block.append(text.strip().removeprefix("data").strip())
    data = " ".join(block)
    return data[data.index("| validation "):]
