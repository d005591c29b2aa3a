"""Context parallelism: real gloo ranks (2 and 4) match one process over PARITY_STEPS (5) steps; the
layout and the checks that run before any process group."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_config
from builders.launch import (GLOBAL_BATCH, PARITY, PARITY_STEPS, SMALL, assert_matches,
                                        launch)
from torchllm.config import ConfigError
from torchllm.data import build_data
from torchllm.parallel import ContextParallel
from builders.models import layout_dims
from torchllm.parallel.context_parallel import head_tail_index
from torchllm.train import Trainer
from builders.data import data_args, DOCS, SHORT_DOCS, fill, write_short_docs  # noqa: F401

CP = "--parallelism.context_parallel_degree=2"
WINDOW = ("--model.sliding_window=5",)
GPT2 = ("--model.name=gpt2", "--model.tie_embeddings=false")
TWO = {
    "cp2": [CP, f"--training.local_batch_size={GLOBAL_BATCH}"],
    "cp2_block_causal": [CP, *DOCS, f"--training.local_batch_size={GLOBAL_BATCH}"],
    "cp2_window_accumulate": [CP, *WINDOW, "--training.local_batch_size=4"],
    "cp2_gpt2_block_causal": [CP, *GPT2, *DOCS, f"--training.local_batch_size={GLOBAL_BATCH}"],
}
FOUR = {
    "cp2_fsdp2": [CP, "--parallelism.data_parallel_shard_degree=2",
                  "--training.local_batch_size=4"],
    "cp2_hsdp_block_causal": [CP, *DOCS, "--parallelism.data_parallel_replicate_degree=2",
                              "--training.local_batch_size=4"],
    "cp2_tp2": [CP, "--parallelism.tensor_parallel_degree=2",
                f"--training.local_batch_size={GLOBAL_BATCH}"],
}
REFERENCE = {"cp2": (), "cp2_block_causal": DOCS, "cp2_window_accumulate": WINDOW,
             "cp2_gpt2_block_causal": (*GPT2, *DOCS), "cp2_fsdp2": (),
             "cp2_hsdp_block_causal": DOCS, "cp2_tp2": ()}


def test_head_tail_chunks_partition_the_window():
    for cp in (1, 2, 4):
        parts = [head_tail_index(32, cp, r) for r in range(cp)]
        assert sorted(torch.cat(parts).tolist()) == list(range(32))
        # Load balance: every rank's causal work (sum of query indices + 1) is equal.
        assert len({int((p + 1).sum()) for p in parts}) == 1
    assert head_tail_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


def test_shard_keeps_whole_window_documents():
    """Document ids and positions come from the whole window, then are split."""
    positions = torch.tensor([[5, 6, 7, 0, 1, 2, 3, 4, 0, 1, 2, 3]])
    tokens = torch.arange(12)[None]
    full = ContextParallel().shard(tokens, tokens, positions)[2]
    for rank in (0, 1):
        inputs, _, layout = ContextParallel(2, rank).shard(tokens, tokens, positions)
        assert torch.equal(inputs[0], layout.index)
        assert torch.equal(layout.doc_ids, full.doc_ids[:, layout.index])
        assert torch.equal(layout.positions, full.positions[:, layout.index])


@pytest.mark.parametrize("extra, match", [
    ((CP, "--parallelism.data_parallel_shard_degree=2"), "cp=2 x tp=1 = 4, but the world size"),
    ((CP, "--parallelism.dp_mode=ddp"), "dp_mode = 'ddp' does not compose"),
    ((CP, "--training.seq_len=18"), "not a multiple of 2 x context_parallel_degree"),
    ((CP, "--training.seq_len=16", "--training.seq_len_schedule=2:0.5,16:1.0"),
     "training.seq_len_schedule: sequence length 2"),
    (("--parallelism.context_parallel_degree=0",), "context_parallel_degree = 0"),
    ((CP, "--model.dropout=0.1"), "model.dropout = 0.1 with context_parallel_degree"),
])
def test_bad_cp_layouts_fail_before_process_groups(tmp_path, extra, match):
    cfg = tiny_config(tmp_path, *extra)
    with pytest.raises(ConfigError, match=match):
        layout_dims(cfg, 2, "cpu")


def test_cp_validates_and_resolves_dp_shard(tmp_path):
    cfg = tiny_config(tmp_path, CP, "--training.seq_len=16")
    dims = layout_dims(cfg, 4, "cpu")
    assert (dims.dp_shard, dims.cp, dims.dp_degree, dims.fsdp_enabled) == (2, 2, 2, True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp")
    write_short_docs(tmp / "short_docs.jsonl")
    by_args = {}
    for extra in set(REFERENCE.values()):
        cfg = tiny_config(tmp, *PARITY, f"--training.local_batch_size={GLOBAL_BATCH}",
                          *fill(extra, tmp))
        trainer = Trainer(cfg)
        if SHORT_DOCS in extra:  # the block_causal runs really see several documents a window
            loader, _ = build_data(*data_args(cfg), trainer.tokenizer, 0, 1)  # (not the trainer's own)
            positions = next(iter(loader))["positions"]
            assert (positions[:, 1:] == 0).sum() >= positions.shape[0]
        metrics = [trainer.train_step() for _ in range(PARITY_STEPS)]
        trainer.close()  # frees the run folder for the ranks' runs
        by_args[extra] = {k: [m[k] for m in metrics] for k in ("loss", "grad_norm")}
    return tmp, {name: by_args[extra] for name, extra in REFERENCE.items()}


@pytest.mark.slow
def test_cp_layouts_match_single_process(reference):
    """CP=2 (causal, block_causal, sliding window, GPT-2) on 2 ranks and CP x FSDP2 / HSDP / TP
    on 4 ranks: every step's loss equals one process's (rel 1e-4)."""
    tmp, refs = reference
    two = {name: fill(args, tmp) for name, args in TWO.items()}
    four = {name: fill(args, tmp) for name, args in FOUR.items()}
    results = {**launch(tmp, 2, two, **SMALL), **launch(tmp, 4, four, **SMALL)}
    for name in REFERENCE:
        assert_matches(results[name], refs[name], loose=False)
