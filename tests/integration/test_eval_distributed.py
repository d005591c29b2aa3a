"""Two gloo ranks give the same HellaSwag result and validation loss as one process."""

from __future__ import annotations

import torch
import pytest

import numpy as np

from torchllm.data.token_stream import TokenStream
from torchllm.data.windows import ValWindows
from torchllm.data.tokenizer import SentencePieceTokenizer
from torchllm.eval import hellaswag
from torchllm.eval.in_training import HeldOutBatches
from torchllm.eval.validation import validate

from conftest import SHARED, spawn_gloo
from builders.eval import tiny_model, tokenizer, write_tiny_jsonl  # noqa: F401 (fixture)

CPU = torch.device("cpu")
VAL_STEPS, VAL_BATCH = 3, 2


def val_loader(rank: int, world: int) -> HeldOutBatches:
    """In-training validation's batches of 12 of 14 windows: 6 per rank, 3 full batches each."""
    tokens = np.random.default_rng(0).integers(0, 512, 17 * 14)
    windows = ValWindows(TokenStream([tokens], np.array([0])), 16)
    return HeldOutBatches(windows, 12, VAL_BATCH, rank, world)


def _worker(rank: int, tmp, world: int, tokenizer_path: str, examples: list[dict]) -> None:
    torch.set_num_threads(1)
    model, tokenizer = tiny_model(max_seq_len=384), SentencePieceTokenizer(tokenizer_path)
    result = hellaswag.evaluate(model, tokenizer, examples, CPU, batch_size=2)
    val = validate(model, val_loader(rank, world), VAL_STEPS, CPU)
    torch.save({"hellaswag": vars(result), "val": val}, f"{tmp}/rank{rank}.pt")


@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path, tokenizer):
    examples = hellaswag.load_examples(str(write_tiny_jsonl(tmp_path / "tiny.jsonl")))
    real = SHARED / "data" / "hellaswag_val.jsonl"
    if real.is_file():  # plus a slice of the real set when ../shared is present
        examples += hellaswag.load_examples(str(real), limit=4)
    # An odd count, 2 per batch: rank 1 runs one discarded batch so that both ranks run the
    # same number of forward passes (5 examples: 2 batches on rank 0, 1 + 1 on rank 1).
    spawn_gloo(_worker, tmp_path, 2, str(tokenizer.path), examples)

    model = tiny_model(max_seq_len=384)
    single = hellaswag.evaluate(model, tokenizer, examples, CPU, batch_size=2)
    # Validation oracle: one process over the union of the batches the two ranks saw.
    union = [b for r in range(2) for b in val_loader(r, 2)]
    single_val = validate(model, union, len(union), CPU)
    assert len(union) == 2 * VAL_STEPS

    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        hs = out["hellaswag"]
        assert (hs["n"], hs["acc"], hs["acc_norm"]) == (single.n, single.acc, single.acc_norm)
        key = lambda p: (p["index"], p["label"], p["pred"], p["pred_norm"])  # noqa: E731
        assert [key(p) for p in hs["predictions"]] == [key(p) for p in single.predictions]
        for p, q in zip(hs["predictions"], single.predictions):
            assert p["sum_loss"] == pytest.approx(q["sum_loss"], rel=1e-5)
        assert out["val"]["val/tokens"] == single_val["val/tokens"]
        assert out["val"]["val/loss"] == pytest.approx(single_val["val/loss"], rel=1e-6)
