"""The memory estimator on CUDA shapes: compiled blocks, the compiled loss and float8 linears
keep less for backward than eager autocast; the estimate (allocated bytes, what
`torch.cuda.max_memory_allocated` reports, not the allocator's reserve) against the peaks the
first H200 run recorded (../shared/gpu/2026-11-26_h200/bench_batch*.json)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import REPO, SHARED
from torchllm import models
from torchllm.config import load_config
from torchllm.tools import activation_bytes as ab
from torchllm.tools import estimate_memory as em

LLAMA = models.get("llama3")  # the family whose block these counts describe

H200 = SHARED / "gpu" / "2026-11-26_h200"


def recorded_rows() -> list[tuple[str, dict, dict]]:
    rows = []
    for path in sorted(H200.glob("bench_batch*.json")):
        result = json.loads(path.read_text())
        rows += [(path.name, result, row) for row in result["rows"] if row["status"] == "ok"]
    return rows


def bench_config(result: dict, row: dict):
    """The config bench_gpu ran `row` with (its base args and the variant's keys)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_gpu

    args = [
        "--job.config_file", str(REPO / result["config"]), "--training.device=cuda",
        f"--training.seq_len={result['seq_len']}",
        f"--training.local_batch_size={result['local_batch_size']}",
        "--training.global_batch_size=-1", *bench_gpu.VARIANTS[row["variant"]],
        f"--activation_checkpoint.mode={row['ac']}", "--data.tokenizer=bytes",
        *result["overrides"]]
    return load_config(args)


def test_estimate_within_15_percent_of_the_h200_peaks():
    rows = recorded_rows()
    if not rows:
        pytest.skip(f"{H200} has no bench_batch*.json (../shared is only beside the checkout)")
    ratios = {}
    for name, result, row in rows:
        cfg = bench_config(result, row)
        args = models.model_args(cfg.model, cfg.training, cfg.data)
        e = em.estimate_memory(cfg, args, 1)
        assert e["params"] == row["params"], (name, row["variant"])  # the same model
        ratios[f"{name} {row['variant']}"] = row["peak_bytes"] / e["peak_bytes"]
    assert len(ratios) == 6, ratios  # batch 4, 8, 16 x bf16 / float8, all with compile
    assert all(0.85 <= r <= 1.15 for r in ratios.values()), ratios


def llama_1b(**extra):
    cfg = load_config(["--job.config_file", str(REPO / "train_configs/llama3_1b.toml"),
                       "--training.device=cuda", "--training.mixed_precision=bf16",
                       "--training.local_batch_size=4", "--data.tokenizer=bytes",
                       *[f"--{k}={v}" for k, v in extra.items()]])
    return cfg, models.model_args(cfg.model, cfg.training, cfg.data)


def test_compiled_and_float8_terms_count_what_the_partitioner_saves():
    cfg, args = llama_1b()
    dim, kv, hidden = args.dim, args.n_kv_heads * args.head_dim, args.ffn_hidden_dim
    assert (dim, kv, hidden, args.n_heads) == (2048, 512, 8192, 32)
    # Per token: float32 block input; q, k, v, SDPA out, w1 and w3 outputs, the normed inputs,
    # wo's input and the SwiGLU product in bf16; rstd x 2 and the logsumexp per head in float32.
    bf16 = 4 * dim + 2 * (dim + 2 * kv + dim + 2 * hidden + 3 * dim + hidden) + 4 * (2 + 32)
    assert ab.compiled_block_bytes(args, 1, 2) == bf16 == 80_008
    assert ab.compiled_block_bytes(args, 1, 2, float8=True) == bf16 - 2 * (2 * dim + hidden)
    eager = ab.activation_bytes_per_block(LLAMA, args, 1, 2, "none", "", autocast=True)
    assert ab.activation_bytes_per_block(LLAMA, args, 1, 2, "none", "", True, compiled=True) == bf16
    assert eager > bf16  # eager keeps the float32 residual, norms and bf16 copies too

    tokens = 4 * 2048
    e = em.estimate_memory(cfg, args, 1)
    compiled = em.estimate_memory(*llama_1b(**{"compile.enable": "true"}), 1)
    f8 = em.estimate_memory(*llama_1b(**{"compile.enable": "true", "float8.enable": "true"}), 1)
    n_layers = args.n_layers
    assert e["terms_bytes"]["activations"] - compiled["terms_bytes"]["activations"] == \
        n_layers * (eager - bf16) * tokens
    # The compiled loss keeps the bf16 logits and two float32 numbers per token.
    assert compiled["terms_bytes"]["logits"] == tokens * (args.vocab_size * 2 + 8)
    # Float8: no saved copy of the blocks' linear weights; the tied head's bf16 table stays.
    assert f8["terms_bytes"]["autocast_weights"] == args.vocab_size * dim * 2 + dim * 2
    assert compiled["terms_bytes"]["autocast_weights"] == e["params"] * 2
    # AC other than none: compile does not change what the estimate counts.
    ac = em.estimate_memory(*llama_1b(**{"compile.enable": "true",
                                         "activation_checkpoint.mode": "full"}), 1)
    no_compile_ac = em.estimate_memory(*llama_1b(**{"activation_checkpoint.mode": "full"}), 1)
    assert ac["terms_bytes"]["activations"] == no_compile_ac["terms_bytes"]["activations"]


@pytest.mark.slow
def test_compiled_block_saves_what_compiled_block_bytes_counts():
    """Saved-tensor hooks on a compiled Llama block under bf16 autocast: the activations it
    keeps, each storage once, per token. The backend is inductor's front half without its code
    generation (`aot_eager_decomp_partition`: inductor's decompositions and its min-cut
    partitioner, which decides what is saved, on CPU as on CUDA) -- seconds instead of minutes of
    C++ compilation."""
    from torchllm.models.llama.args import LlamaArgs
    from torchllm.models.llama.model import TransformerBlock, rope_table

    torch.manual_seed(0)
    args = LlamaArgs(dim=128, n_layers=1, n_heads=4, n_kv_heads=1, vocab_size=256,
                     hidden_dim=512, max_seq_len=32)
    block = TransformerBlock(0, args)
    block.init_weights()
    batch, seq = 3, 32
    tokens = batch * seq
    x = torch.randn(batch, seq, args.dim, requires_grad=True)
    saved = {}

    def pack(t):
        if t.dim() and t.shape[0] in (batch, tokens):  # activations (not weights or tables)
            saved[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
        return t

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager_decomp_partition")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", torch.bfloat16):
            compiled(x, rope_table(args)[:seq]).float().sum().backward()
    assert sum(saved.values()) == ab.compiled_block_bytes(args, tokens, 2)
