"""The run header printed at start (instead of the config dump), and readable samples."""

from __future__ import annotations

import json
import logging
import re

import numpy as np

from torchllm.config import load_config
from torchllm.config.loader import to_toml
from torchllm.metrics.header import config_changes
from torchllm.data.token_stream import TokenStream
from torchllm.train import Trainer

from conftest import tiny_args


def rows(header: str) -> dict[str, str]:
    """{label: its text, continuation lines joined} of a header."""
    out, label = {}, None
    for line in header.splitlines()[1:]:
        if line[2:3] != " ":
            label = line[2:12].strip()
            out[label] = line[12:]
        else:  # a continuation, or the next section of "changed"
            out[label] += (" | " if line[12:].split(":")[0].isidentifier() and label == "changed"
                           else " ") + line.strip()
    return out


def test_config_changes_are_exactly_the_non_default_keys(tmp_path):
    cfg = load_config(["--training.steps=7", "--optimizer.lr=0.01", "--data.dataset=embedded",
                       "--eval.prompts=a,b", "--checkpoint.enable"])
    assert config_changes(cfg) == {"training": ["steps=7"], "optimizer": ["lr=0.01"],
                                   "checkpoint": ["enable=True"], "eval": ["prompts=['a', 'b']"]}
    assert config_changes(load_config([])) == {}


def test_documents_in_a_split_range():
    stream = TokenStream([np.arange(100)], np.array([0, 10, 50, 90]))
    # Oracle: count by brute force which documents own a token inside the range.
    owner = np.searchsorted(stream.doc_starts, np.arange(100), side="right") - 1
    for a, b in [(0, 100), (0, 10), (5, 60), (10, 50), (49, 51), (95, 100), (0, 0), (90, 91)]:
        part = TokenStream(stream.parts, stream.doc_starts, a, b)
        assert part.documents() == len(set(owner[a:b].tolist())), (a, b)


def test_trainer_prints_a_short_header_with_the_data_summary(tmp_path, caplog):
    rng = np.random.default_rng(0)
    vocab = [f"w{i}x{j}" for i in range(40) for j in range(8)]
    texts = [f"document {i} " + " ".join(rng.choice(vocab, 20 + i % 30)) for i in range(60)]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    args = tiny_args(tmp_path, f"--data.dataset=local:{corpus}", "--training.steps=40",
                     "--data.tokenizer_vocab_size=384",
                     "--job.run_name=hdr", "--job.description=header test")
    caplog.set_level(logging.INFO, logger="torchllm")
    logger = logging.getLogger("torchllm")
    logger.propagate = True  # init_logger turns it off; caplog listens on the root
    try:
        trainer = Trainer(load_config(args))
    finally:
        logger.propagate = False
    header = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("run hdr"))
    lines = header.splitlines()
    assert lines[0] == "run hdr: header test" and len(lines) <= 20
    assert "[training]" not in header  # no TOML dump
    assert (tmp_path / "hdr" / "config.toml").read_text() == to_toml(trainer.cfg)
    assert "training: steps=40 seq_len=32 local_batch_size=4" in rows(header)["changed"]
    # Oracle for the data line: the tokens and documents of the training split by brute force
    # (validation off: embedded/local corpora hold nothing out, every token trains).
    lengths = [len(trainer.tokenizer.encode(t, bos=True, eos=True)) for t in texts]
    total = sum(lengths)
    train_tokens = total
    starts = np.cumsum([0] + lengths[:-1])
    train_docs = int((starts < train_tokens).sum())
    windows = train_tokens // 33
    data = rows(header)["data"]
    m = re.search(r"train ([\d,]+) documents, ([\d,]+) tokens = ([\d,]+) windows of 33 tokens "
                  r"per epoch; 40 steps x 4 = ([\d.]+) epochs", data)
    assert m, data
    assert [int(g.replace(",", "")) for g in m.groups()[:3]] == [train_docs, train_tokens, windows]
    assert float(m.group(4)) == float(f"{40 * 4 / windows:.3g}")
    assert rows(header)["tokenizer"].startswith(f"SentencePiece {tmp_path / 'hdr' / 'data'}")
    assert rows(header)["parallel"] == "1 process on cpu: no data parallelism | fp32 | " \
        "compile off | AC none"


def test_parallel_line_names_every_dim_in_use():
    from torchllm.metrics.header import parallel_summary
    from torchllm.parallel import ParallelPlan
    from torchllm.parallel.dims import ParallelDims

    def plan(cfg):
        return ParallelPlan.of(parallelism=cfg.parallelism, float8=cfg.float8,
                               activation_checkpoint=cfg.activation_checkpoint,
                               compile=cfg.compile, training=cfg.training)

    cfg = load_config(["--parallelism.pipeline_parallel_degree=2",
                       "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                       "--parallelism.pipeline_parallel_microbatch_size=2"])
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, world_size=32, cp=2, ep=2, pp=2)
    line = parallel_summary(dims, "cuda", "bf16", plan(cfg))
    assert line.startswith("32 processes on cuda: PP 2 (Interleaved1F1B, micro-batches of 2) x "
                           "HSDP replicate 2 x shard 2, CP 2, TP 2, EP 2 | bf16 |"), line
    plain = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, world_size=1)
    assert parallel_summary(plain, "cpu", "fp32", plan(load_config([]))).startswith(
        "1 process on cpu: no data parallelism | fp32")
