"""Active vs total parameters of MoE models (FLOPs/MFU from the active ones, memory from all),
against a brute-force count over the debug MoE model's named parameters."""

from __future__ import annotations

import pytest
import torch

from torchllm import models
from torchllm.config import load_config
from torchllm.metrics.flops import flops_per_token, parameter_counts
from torchllm.metrics.header import active_params
from torchllm.tools.estimate_memory import FP32, estimate_memory
from torchllm.tools.model_info import model_info

SEQ = 32


def config(*extra):
    return load_config(["--model.name=qwen3_moe", "--model.flavor=debug",
                        "--data.tokenizer_vocab_size=512", f"--training.seq_len={SEQ}",
                        "--training.device=cpu", "--training.mixed_precision=none", *extra])


def debug_moe(cfg):
    with torch.device("meta"):
        return models.get("qwen3_moe").build(models.model_args(cfg.model, cfg.training, cfg.data,
                                                               512))


def brute_force(model) -> dict[str, int]:
    """Walk the named parameters: a token runs through everything but the experts it is not
    routed to, i.e. top_k of each MoE layer's n_experts expert slices."""
    args = model.args
    total = active = moe = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".feed_forward." in name and args.is_moe_layer(int(name.split(".")[1])):
            moe += p.numel()
        if ".experts." in name:
            assert p.shape[0] == args.n_experts
            active += args.n_experts_per_tok * p[0].numel()  # top-k expert slices
        else:
            active += p.numel()
    embedding = model.tok_embeddings.weight.numel()
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * SEQ
    tied = args.vocab_size * args.dim if args.tie_embeddings else 0
    return {"params": total, "active_params": active, "moe_layer_params": moe,
            "flops_per_token": 6 * (active - embedding + tied) + attention}


@pytest.mark.parametrize("tied", [False, True])
def test_active_and_total_counts_and_flops(tied):
    cfg = config(f"--model.tie_embeddings={str(tied).lower()}")
    model = debug_moe(cfg)
    expected = brute_force(model)
    counts = parameter_counts(model)
    assert counts["params"] == expected["params"]
    assert counts["active_params"] == expected["active_params"]
    assert counts["active_params"] < counts["params"]  # 2 of 8 experts
    assert flops_per_token(model, SEQ) == expected["flops_per_token"]
    info = model_info(cfg.model, cfg.training, cfg.data)
    assert info["active_params"] == expected["active_params"]
    assert info["flops_per_token"] == expected["flops_per_token"]
    assert active_params(counts) == f", {expected['active_params']:,} active per token"
    dense = load_config(["--model.name=qwen3"])
    assert active_params(parameter_counts(models.get("qwen3").build(
        models.model_args(dense.model, dense.training, dense.data, 512)))) == ""


@pytest.mark.parametrize("tp", [1, 2])
def test_estimator_stores_every_expert_and_tp_does_not_split_them(tp):
    """Memory counts all parameters; TP divides all but the MoE layers (replicated over tp)."""
    cfg = config("--model.tie_embeddings=false", f"--parallelism.tensor_parallel_degree={tp}",
                 "--parallelism.data_parallel_shard_degree=1")
    expected = brute_force(debug_moe(cfg))
    args = models.model_args(cfg.model, cfg.training, cfg.data, 512)
    out = estimate_memory(cfg, args, world_size=tp)
    assert out["params"] == expected["params"] and out["flops_per_token"] == expected[
        "flops_per_token"]
    moe = expected["moe_layer_params"]
    assert out["terms_bytes"]["params"] == (expected["params"] - moe) * FP32 // tp + moe * FP32


@pytest.mark.slow
@pytest.mark.parametrize("name, low", [("qwen3", 0.95), ("qwen3_moe", 0.85)])
def test_estimate_of_qwen3_activations_against_measured(tmp_path, name, low):
    """Activation-dominated step (8 x 128 tokens, fp32), measured tensor bytes vs estimate:
    QK-norm's extra q/k copies and the MoE's routed copies are counted (without them: 0.80 and
    0.71). The MoE's lower band: the CPU path pads experts to the busiest one's load, which the
    estimate (balanced experts) leaves out: how busy depends on the tokens routed (0.95 measured
    on the 95% split; 0.87 since validation off trains on every window; issue 62 keeps this gap
    open, bench_memory's ep2 row too)."""
    from builders.memory import measure

    measured, estimate = measure(tmp_path, f"--model.name={name}",
                                 "--training.local_batch_size=8", "--training.seq_len=128")
    assert low <= estimate["peak_bytes"] / measured <= 1.05, (estimate, measured)
