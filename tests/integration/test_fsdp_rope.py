"""FSDP2 with bf16 params keeps RoPE in float32 (issue 21, item 8): 2 real gloo ranks against
one process whose parameters (not buffers) are bf16."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import build_model, spawn_gloo


def worker(rank: int, tmp_path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from torchllm.models.llama.args import LlamaArgs
    from torchllm.models.llama.model import Transformer
    from torchllm.parallel.data_parallel import apply_fsdp

    torch.set_num_threads(1)
    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=256,
                     rope_theta=10000.0)
    model = build_model(Transformer, args)
    reference = copy.deepcopy(model)
    for p in reference.parameters():  # bf16 weights; the RoPE table stays float32
        p.data = p.data.bfloat16()
    apply_fsdp(model, init_device_mesh("cpu", (2,)), param_dtype=torch.bfloat16,
               reduce_dtype=torch.float32)
    tokens = torch.randint(0, 64, (1, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(tokens).float(), reference(tokens).float()
    result = {"max_diff": (got - want).abs().max().item(),
              "scale": want.abs().max().item()}
    (tmp_path / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_fsdp2_bf16_params_keep_rope_in_float32(tmp_path):
    spawn_gloo(worker, tmp_path)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # Same bf16 weights, same kernels: only a bf16-rounded RoPE table would differ.
        assert r["max_diff"] <= 1e-6 * r["scale"], r
