"""The before-save NaN/inf check (checkpoint/integrity.nonfinite_and_bytes): `isfinite` on every
tensor, torchao's 8-bit optimizer states included, and no false alarm for finite values whose
sum overflows float32 (issue 52, item 10)."""

from __future__ import annotations

import pytest
import torch

from torchllm.checkpoint import complete_steps
from torchllm.checkpoint.integrity import nonfinite_and_bytes
from torchllm.train import Trainer

from conftest import tiny_config


def test_finite_values_whose_sum_overflows_are_saved_complete(tmp_path):
    """1000 x 1e36 (finite; their float32 sum is inf): the step is COMPLETE, not NONFINITE."""
    big = torch.full((1000,), 1e36)
    assert nonfinite_and_bytes([big]) == (0, 4000)
    t = Trainer(tiny_config(tmp_path, "--checkpoint.enable", "--job.run_name=run",
                            "--training.steps=1"))
    t.train()
    with torch.no_grad():
        t.model.tok_embeddings.weight.view(-1)[:1000] = 1e36
    t.checkpointer.save(2)
    folder = tmp_path / "run" / "checkpoint"
    assert complete_steps(folder) == [1, 2]
    assert not (folder / "step-2" / "NONFINITE").exists()


def test_nonfinite_values_in_plain_tensors_are_counted():
    a, b, c = torch.zeros(4), torch.zeros(3, dtype=torch.bfloat16), torch.arange(5)
    a[1], b[2] = float("nan"), float("-inf")
    assert nonfinite_and_bytes([a, b, c, torch.ones(2)]) == (2, 16 + 6 + 40 + 8)


@pytest.mark.parametrize("part", ["scale", "qmap"])
def test_nonfinite_in_a_torchao_8bit_optimizer_state_is_counted(part):
    """AdamW8bit's moments (OptimState8bit: uint8 codes, float scale and quantile map): NaN/inf
    in an inner float tensor is found; a finite state is not flagged."""
    subclass = pytest.importorskip("torchao.optim.subclass_8bit")
    state = subclass.OptimState8bit.zeros((64, 256), signed=True, block_size=256)
    assert nonfinite_and_bytes([state])[0] == 0
    getattr(state, part)[0] = float("nan") if part == "scale" else float("inf")
    assert nonfinite_and_bytes([state, torch.zeros(3)])[0] == 1
